/* Region decode of a JPEG with libjpeg-turbo's own API (>= 1.5: jpeg_crop_scanline, jpeg_skip_scanlines), for the
 * loader's RandomResizedCrop (doeks/workload/train.py, docs/loader.md): the crop's rows only (the rows above are
 * entropy-decoded but neither inverse-transformed nor colour-converted, nothing below is read), the crop's iMCU
 * columns only, at a DCT-domain scale of 1/scale.
 *
 *   decode_crop(data, scale, top, left, height, width, flags) -> bytearray of height x width x 3 (RGB, uint8), or
 *   None for a colour space it does not take (CMYK, YCCK); ValueError for data libjpeg cannot read. flags: 1 fast
 *   integer IDCT, 2 merged (fast) chroma upsampling, 4 (the module's BGR) B, G, R order instead of R, G, B (the same
 *   values: libjpeg's colour conversion writes them in that order; the loader's flip reverses a row's bytes).
 *
 * top/left/height/width are in the coordinates of the scaled image (ceil(size / scale)). Build: python -m
 * doeks.workload.jpegcrop_build (a C compiler and libjpeg's headers: libjpeg62-turbo-dev on Debian, libjpeg-turbo8-dev
 * on Ubuntu). Without it the loader takes simplejpeg's whole-image decode (same crops). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <jpeglib.h>

#if JPEG_LIB_VERSION < 62
#error "libjpeg(-turbo) with the jpeg 6b API or later is needed"
#endif

struct error_mgr {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    char message[JMSG_LENGTH_MAX];
};

static void on_error(j_common_ptr cinfo) {
    struct error_mgr *err = (struct error_mgr *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->message);
    longjmp(err->jump, 1);
}

static void on_message(j_common_ptr cinfo, int level) {
    (void)cinfo;
    (void)level; /* warnings (a truncated file is padded, as simplejpeg and PIL do) are not printed */
}

/* 0: decoded; 1: libjpeg error (message in err); 2: colour space not taken; 3: box outside the scaled image */
static int decode(const unsigned char *data, size_t size, int scale, int top, int left, int height, int width,
                  int fast, unsigned char *out, struct error_mgr *err) {
    struct jpeg_decompress_struct cinfo;
    unsigned char *volatile row = NULL;
    int status = 0;

    cinfo.err = jpeg_std_error(&err->pub);
    err->pub.error_exit = on_error;
    err->pub.emit_message = on_message;
    jpeg_create_decompress(&cinfo);
    if (setjmp(err->jump)) {
        jpeg_destroy_decompress(&cinfo);
        free(row);
        return 1;
    }
    jpeg_mem_src(&cinfo, (unsigned char *)data, (unsigned long)size);
    jpeg_read_header(&cinfo, TRUE);
    if (cinfo.jpeg_color_space != JCS_YCbCr && cinfo.jpeg_color_space != JCS_GRAYSCALE &&
        cinfo.jpeg_color_space != JCS_RGB) {
        jpeg_destroy_decompress(&cinfo);
        return 2;
    }
    cinfo.out_color_space = (fast & 4) ? JCS_EXT_BGR : JCS_RGB;
    cinfo.scale_num = 1;
    cinfo.scale_denom = (unsigned int)scale;
    if (fast & 1)
        cinfo.dct_method = JDCT_IFAST;
    if (fast & 2)
        cinfo.do_fancy_upsampling = FALSE;
    jpeg_calc_output_dimensions(&cinfo);
    if (top < 0 || left < 0 || height < 1 || width < 1 || (JDIMENSION)(top + height) > cinfo.output_height ||
        (JDIMENSION)(left + width) > cinfo.output_width) {
        jpeg_destroy_decompress(&cinfo);
        return 3;
    }
    jpeg_start_decompress(&cinfo);
    JDIMENSION x = (JDIMENSION)left, w = (JDIMENSION)width;
    jpeg_crop_scanline(&cinfo, &x, &w); /* widened to whole iMCUs: x <= left, x + w >= left + width */
    row = malloc((size_t)cinfo.output_width * cinfo.output_components);
    if (row == NULL) {
        jpeg_destroy_decompress(&cinfo);
        return 4;
    }
    if (top > 0)
        jpeg_skip_scanlines(&cinfo, (JDIMENSION)top);
    size_t offset = (size_t)(left - (int)x) * 3, stride = (size_t)width * 3;
    for (int r = 0; r < height; r++) {
        JSAMPROW rows[1] = {row};
        if (jpeg_read_scanlines(&cinfo, rows, 1) != 1) {
            status = 1;
            snprintf(err->message, sizeof err->message, "no scanline %d", top + r);
            break;
        }
        memcpy(out + (size_t)r * stride, row + offset, stride);
    }
    jpeg_abort_decompress(&cinfo); /* the rows below the crop are never read */
    jpeg_destroy_decompress(&cinfo);
    free(row);
    return status;
}

static PyObject *decode_crop(PyObject *self, PyObject *args) {
    Py_buffer data;
    int scale, top, left, height, width, fast;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*iiiiii", &data, &scale, &top, &left, &height, &width, &fast))
        return NULL;
    if (scale != 1 && scale != 2 && scale != 4 && scale != 8) {
        PyBuffer_Release(&data);
        return PyErr_Format(PyExc_ValueError, "scale must be 1, 2, 4 or 8, not %d", scale);
    }
    if (height < 1 || width < 1 || (Py_ssize_t)height * width > PY_SSIZE_T_MAX / 3) {
        PyBuffer_Release(&data);
        return PyErr_Format(PyExc_ValueError, "bad box %d x %d", height, width);
    }
    PyObject *out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)height * width * 3);
    if (out == NULL) {
        PyBuffer_Release(&data);
        return NULL;
    }
    struct error_mgr err;
    int status;
    err.message[0] = 0;
    Py_BEGIN_ALLOW_THREADS
    status = decode((const unsigned char *)data.buf, (size_t)data.len, scale, top, left, height, width, fast,
                    (unsigned char *)PyByteArray_AS_STRING(out), &err);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    if (status == 0)
        return out;
    Py_DECREF(out);
    if (status == 2)
        Py_RETURN_NONE;
    if (status == 3)
        return PyErr_Format(PyExc_ValueError, "box (%d, %d, %d, %d) outside the image at 1/%d", top, left, height,
                            width, scale);
    if (status == 4)
        return PyErr_NoMemory();
    return PyErr_Format(PyExc_ValueError, "libjpeg: %s", err.message);
}

static PyMethodDef methods[] = {
    {"decode_crop", decode_crop, METH_VARARGS,
     "decode_crop(data, scale, top, left, height, width, flags) -> bytearray (height x width x 3 RGB, BGR with flag "
     "BGR) or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_jpegcrop", NULL, -1, methods};

PyMODINIT_FUNC PyInit__jpegcrop(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL) {
        PyModule_AddIntConstant(m, "LIBJPEG_TURBO_VERSION", LIBJPEG_TURBO_VERSION_NUMBER);
        PyModule_AddIntConstant(m, "BGR", 4); /* the flag; a module built before it lacks the name */
    }
    return m;
}
