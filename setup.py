"""The one compiled part: stoker/data/pixels/_jpegcrop.c, libjpeg-turbo's partial decoding (needs a C compiler and
libjpeg-turbo's headers, Debian's libjpeg62-turbo-dev). Without it stoker decodes whole JPEGs, to the same pixels."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("stoker.data.pixels._jpegcrop", ["stoker/data/pixels/_jpegcrop.c"],
                             libraries=["jpeg"], optional=True)])
