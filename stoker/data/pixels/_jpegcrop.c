/* Decode one rectangle of a JPEG at a reduced DCT scale, through libjpeg-turbo's partial decoding.
 *
 * decode(data, scale_num, top, left, height, width, to_end=1) -> (pixels, left_decoded, width_decoded)
 *
 * The rectangle is in the coordinates of the image scaled by scale_num/8. Rows above and below it are skipped with
 * jpeg_skip_scanlines (entropy-decoded, so every warning is still seen, but no IDCT, upsampling or colour
 * conversion); columns are narrowed with jpeg_crop_scanline, which widens them to the scaled iMCU grid:
 * `pixels` holds height rows of width_decoded RGB pixels starting at column left_decoded. Every warning is an error
 * (a ValueError with libjpeg's message), as simplejpeg's strict=True. With to_end=0 the rows below the rectangle
 * are not read at all: for a file that has decoded whole before (damage below the box shows only there). Settings
 * are TurboJPEG's defaults, as
 * simplejpeg decodes: ISLOW DCT, fancy upsampling, RGB out, so the pixels match its whole decode (tested).
 *
 * No Python object is touched while libjpeg runs, and the GIL is released there.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <setjmp.h>
#include <stdio.h>
#include <string.h>
#include <jpeglib.h>

struct failure {
    struct jpeg_error_mgr manager;
    jmp_buf jump;
    char message[JMSG_LENGTH_MAX];
};

static void fail(j_common_ptr info) {
    struct failure *failure = (struct failure *)info->err;
    (*info->err->format_message)(info, failure->message);
    longjmp(failure->jump, 1);
}

static void warn_as_error(j_common_ptr info, int level) {
    if (level < 0) /* a warning: damaged data libjpeg would otherwise fill in and pass */
        fail(info);
}

static PyObject *decode(PyObject *self, PyObject *args) {
    Py_buffer data;
    int scale_num, top, left, height, width, to_end = 1;
    if (!PyArg_ParseTuple(args, "y*iiiii|p", &data, &scale_num, &top, &left, &height, &width, &to_end))
        return NULL;
    if (scale_num < 1 || scale_num > 8 || top < 0 || left < 0 || height < 1 || width < 1) {
        PyBuffer_Release(&data);
        PyErr_SetString(PyExc_ValueError, "scale must be 1-8 eighths and the rectangle non-empty");
        return NULL;
    }
    struct jpeg_decompress_struct info;
    struct failure failure;
    PyObject *volatile pixels = NULL;
    PyThreadState *volatile state = NULL;
    memset(&info, 0, sizeof info);
    info.err = jpeg_std_error(&failure.manager);
    failure.manager.error_exit = fail;
    failure.manager.emit_message = warn_as_error;
    failure.message[0] = 0;
    if (setjmp(failure.jump)) {
        jpeg_destroy_decompress(&info);
        if (state) PyEval_RestoreThread(state);
        PyBuffer_Release(&data);
        Py_XDECREF(pixels);
        PyErr_SetString(PyExc_ValueError, failure.message);
        return NULL;
    }
    jpeg_create_decompress(&info);
    jpeg_mem_src(&info, (const unsigned char *)data.buf, (unsigned long)data.len);
    jpeg_read_header(&info, TRUE);
    info.scale_num = (unsigned int)scale_num;
    info.scale_denom = 8;
    info.out_color_space = JCS_RGB;
    info.dct_method = JDCT_ISLOW;
    info.do_fancy_upsampling = TRUE;
    jpeg_start_decompress(&info);
    if ((unsigned long)top + (unsigned long)height > info.output_height ||
        (unsigned long)left + (unsigned long)width > info.output_width) {
        snprintf(failure.message, sizeof failure.message, "rectangle outside the %ux%u scaled image",
                 info.output_width, info.output_height);
        jpeg_destroy_decompress(&info);
        PyBuffer_Release(&data);
        PyErr_SetString(PyExc_ValueError, failure.message);
        return NULL;
    }
    JDIMENSION left_decoded = (JDIMENSION)left, width_decoded = (JDIMENSION)width;
    if (width_decoded < info.output_width)
        jpeg_crop_scanline(&info, &left_decoded, &width_decoded);
    pixels = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)height * width_decoded * 3);
    if (!pixels) {
        jpeg_destroy_decompress(&info);
        PyBuffer_Release(&data);
        return NULL;
    }
    unsigned char *out = (unsigned char *)PyBytes_AS_STRING(pixels);
    state = PyEval_SaveThread();
    if (top > 0 && jpeg_skip_scanlines(&info, (JDIMENSION)top) != (JDIMENSION)top) {
        snprintf(failure.message, sizeof failure.message, "Premature end of JPEG file");
        longjmp(failure.jump, 1);
    }
    for (int row = 0; row < height;) {
        JSAMPROW line = out + (size_t)row * width_decoded * 3;
        JDIMENSION got = jpeg_read_scanlines(&info, &line, 1);
        if (got == 0) {
            snprintf(failure.message, sizeof failure.message, "Premature end of JPEG file");
            longjmp(failure.jump, 1);
        }
        row += (int)got;
    }
    /* With to_end, the rows below are entropy-decoded too (no IDCT, no colour conversion), to the end marker:
     * damage there (a zeroed stretch, a cut) refuses the file as the whole decode does, whatever the crop, and
     * libjpeg reports a zeroed stretch only there. Without, the decode stops here (a file that decoded whole
     * before: 0.74 -> 0.59 ms for a centred half-size box of an ImageNet-like photo). */
    JDIMENSION rest = to_end ? info.output_height - info.output_scanline : 0;
    if (rest > 0) {
        /* All but the last row: skipping to the very end would mark the image done without decoding it. */
        if (rest > 1 && jpeg_skip_scanlines(&info, rest - 1) != rest - 1) {
            snprintf(failure.message, sizeof failure.message, "Premature end of JPEG file");
            longjmp(failure.jump, 1);
        }
        JSAMPARRAY last = (*info.mem->alloc_sarray)((j_common_ptr)&info, JPOOL_IMAGE, width_decoded * 3, 1);
        if (jpeg_read_scanlines(&info, last, 1) != 1) {
            snprintf(failure.message, sizeof failure.message, "Premature end of JPEG file");
            longjmp(failure.jump, 1);
        }
    }
    if (to_end)
        jpeg_finish_decompress(&info);
    else
        jpeg_abort_decompress(&info);
    PyEval_RestoreThread(state);
    state = NULL;
    jpeg_destroy_decompress(&info);
    PyBuffer_Release(&data);
    PyObject *result = Py_BuildValue("(Oii)", pixels, (int)left_decoded, (int)width_decoded);
    Py_DECREF(pixels);
    return result;
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS,
     "decode(data, scale_num, top, left, height, width, to_end=1) -> (rgb bytes, left_decoded, width_decoded)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_jpegcrop", NULL, -1, methods};

PyMODINIT_FUNC PyInit__jpegcrop(void) { return PyModule_Create(&module); }
