"""How bytes of remote objects reach a producer: ranged reads over libcurl, and object stores through obstore."""
