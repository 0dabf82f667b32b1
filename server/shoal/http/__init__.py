"""The HTTP/REST transport (KServe v2 REST and Triton's extensions): thin handlers over ``shoal.core``."""
