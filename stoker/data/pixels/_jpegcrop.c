/* Decode one rectangle of a JPEG at a reduced DCT scale, through libjpeg-turbo's partial decoding; and rewrite a
 * JPEG losslessly with a restart marker after every MCU, so that a rectangle's decode reads only its own MCUs.
 *
 * decode(data, scale_num, top, left, height, width, to_end=1) -> (pixels, left_decoded, width_decoded)
 *
 * The rectangle is in the coordinates of the image scaled by scale_num/8. Rows above and below it are skipped with
 * jpeg_skip_scanlines (entropy-decoded, so every warning is still seen, but no IDCT, upsampling or colour
 * conversion); columns are narrowed with jpeg_crop_scanline, which widens them to the scaled iMCU grid:
 * `pixels` holds height rows of width_decoded RGB pixels starting at column left_decoded. Every warning is an error
 * (a ValueError with libjpeg's message), as simplejpeg's strict=True. With to_end=0 the rows below the rectangle
 * are not read at all: for a file that has decoded whole before (damage below the box shows only there); and a file
 * with a restart marker after every MCU (one restart_every_mcu wrote) is first cut down to the MCUs around the
 * rectangle, so the entropy decoder reads nothing else either. Settings are TurboJPEG's defaults, as simplejpeg
 * decodes: ISLOW DCT, fancy upsampling, RGB out, so the pixels match its whole decode (tested).
 *
 * restart_every_mcu(data) -> bytes or None
 *
 * The same DCT coefficients, quantization tables and colour space (so the same pixels from any decoder that, as
 * stoker, applies no EXIF orientation or ICC profile), written as a baseline JPEG with optimized Huffman tables and
 * a restart interval of one MCU (a single component's MCU one block), without the APPn and COM markers stoker never
 * reads; None for a file it does not apply to (not YCbCr or greyscale, or progressive with a
 * coefficient's low bits never sent, which libjpeg decodes smoothed). An arithmetic-coded file is rewritten
 * Huffman-coded; a damaged file, or one of 12-bit samples, is a ValueError, as in decode.
 *
 * No Python object is touched while libjpeg runs, and the GIL is released there.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <jpeglib.h>
#include <jerror.h>

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

/* A decode that got fewer rows than the image has: libjpeg's own words for a file cut short. */
static void end_too_soon(struct failure *failure) {
    snprintf(failure->message, sizeof failure->message, "Premature end of JPEG file");
    longjmp(failure->jump, 1);
}

static void warn_as_error(j_common_ptr info, int level) {
    if (level < 0) /* a warning: damaged data libjpeg would otherwise fill in and pass */
        fail(info);
}

/* libjpeg's errors and warnings made a longjmp to failure->jump, with the message in failure->message. */
static struct jpeg_error_mgr *errors_to(struct failure *failure) {
    jpeg_std_error(&failure->manager);
    failure->manager.error_exit = fail;
    failure->manager.emit_message = warn_as_error;
    failure->message[0] = 0;
    return &failure->manager;
}

/* Where a JPEG's MCUs lie, for one that restart_every_mcu wrote: a baseline frame of 8-bit samples, a restart
 * interval of one MCU and a single scan holding every component. */
struct layout {
    unsigned width, height;          /* the image's, in pixels */
    unsigned mcu_width, mcu_height;  /* an MCU's, in pixels at full scale */
    size_t frame;                    /* the SOF marker's offset: the cut patches its size */
    size_t scan;                     /* the scan's first entropy-coded byte: everything before is copied */
};

static unsigned big_endian(const unsigned char *p) { return (unsigned)p[0] << 8 | p[1]; }

/* A baseline frame header (its marker at offset `at`, `length` its length field, `p` what follows) into `out`: 8-bit
 * samples, 1 or 3 components with sampling factors 1-4 (1x1 for a single one); 0 for any other. */
static int read_frame(const unsigned char *p, size_t length, size_t at, struct layout *out, unsigned *components) {
    if (length < 8)
        return 0;
    *components = p[5];
    if (p[0] != 8 || (*components != 1 && *components != 3) || length != 8 + 3 * *components)
        return 0;
    unsigned max_h = 1, max_v = 1;
    for (unsigned k = 0; k < *components; k++) {
        unsigned h = p[7 + 3 * k] >> 4, v = p[7 + 3 * k] & 15;
        if (h < 1 || h > 4 || v < 1 || v > 4 || (*components == 1 && (h != 1 || v != 1)))
            return 0;
        max_h = h > max_h ? h : max_h;
        max_v = v > max_v ? v : max_v;
    }
    out->height = big_endian(p + 1);
    out->width = big_endian(p + 3);
    out->mcu_width = 8 * max_h;
    out->mcu_height = 8 * max_v;
    out->frame = at;
    return 1;
}

static int read_layout(const unsigned char *d, size_t n, struct layout *out) {
    size_t i = 2;
    unsigned restart = 0, components = 0;
    if (n < 4 || d[0] != 0xFF || d[1] != 0xD8)
        return 0;
    while (i + 4 <= n) {
        if (d[i] != 0xFF)
            return 0;
        unsigned marker = d[i + 1];
        if (marker == 0xFF) { /* a fill byte */
            i++;
            continue;
        }
        size_t length = big_endian(d + i + 2);
        if (length < 2 || i + 2 + length > n)
            return 0;
        const unsigned char *p = d + i + 4;
        if (marker == 0xC0 || marker == 0xC1) {
            if (!read_frame(p, length, i, out, &components))
                return 0;
        } else if (marker >= 0xC2 && marker <= 0xCF && marker != 0xC4 && marker != 0xC8 && marker != 0xCC) {
            return 0; /* progressive, lossless or arithmetic-coded */
        } else if (marker == 0xDD) {
            restart = length == 4 ? big_endian(p) : 0;
        } else if (marker == 0xDA) {
            if (length < 3 || !components || restart != 1 || p[0] != components || !out->width || !out->height)
                return 0;
            out->scan = i + 2 + length;
            return 1;
        }
        i += 2 + length;
    }
    return 0;
}

/* Each MCU's entropy-coded bytes, [starts[k], ends[k]): 0 unless the scan is exactly `count` of them, one between
 * each two restart markers, ending at the EOI marker. */
static int find_mcus(const unsigned char *d, size_t n, size_t i, size_t *starts, size_t *ends, size_t count) {
    size_t k = 0;
    starts[k] = i;
    while (i + 1 < n) {
        const unsigned char *found = memchr(d + i, 0xFF, n - i - 1);
        if (!found)
            return 0;
        i = (size_t)(found - d);
        unsigned next = d[i + 1];
        if (next == 0x00) { /* a stuffed 0xFF byte of data */
            i += 2;
        } else if (next == 0xFF) { /* fill */
            i++;
        } else if (next >= 0xD0 && next <= 0xD7) {
            ends[k++] = i;
            if (k == count)
                return 0;
            starts[k] = i += 2;
        } else {
            ends[k] = i;
            return next == 0xD9 && k + 1 == count;
        }
    }
    return 0;
}

/* A JPEG of the image's MCU rows first_row..end_row and columns first_column..end_column, its restart markers
 * numbered anew: malloc'd, or NULL. Each MCU is coded on its own (a restart resets the DC predictions), so this
 * decodes to exactly those pixels of the whole image, but for the outermost row and column of pixels on a side that
 * is not the image's own, where the chroma upsampling sees a neighbour no longer there. */
static unsigned char *cut_mcus(const unsigned char *d, const struct layout *layout, const size_t *starts,
                               const size_t *ends, unsigned per_row, unsigned first_row, unsigned end_row,
                               unsigned first_column, unsigned end_column, size_t *length) {
    size_t size = layout->scan + 2;
    for (unsigned row = first_row; row < end_row; row++)
        for (unsigned column = first_column; column < end_column; column++) {
            size_t k = (size_t)row * per_row + column;
            size += ends[k] - starts[k] + 2;
        }
    unsigned char *cut = malloc(size);
    if (!cut)
        return NULL;
    unsigned height = layout->height < end_row * layout->mcu_height ? layout->height : end_row * layout->mcu_height;
    unsigned width = layout->width < end_column * layout->mcu_width ? layout->width : end_column * layout->mcu_width;
    height -= first_row * layout->mcu_height;
    width -= first_column * layout->mcu_width;
    memcpy(cut, d, layout->scan);
    unsigned char *frame = cut + layout->frame + 5;
    frame[0] = (unsigned char)(height >> 8), frame[1] = (unsigned char)height;
    frame[2] = (unsigned char)(width >> 8), frame[3] = (unsigned char)width;
    size_t at = layout->scan, written = 0;
    for (unsigned row = first_row; row < end_row; row++)
        for (unsigned column = first_column; column < end_column; column++, written++) {
            size_t k = (size_t)row * per_row + column;
            if (written) {
                cut[at++] = 0xFF;
                cut[at++] = (unsigned char)(0xD0 + ((written - 1) & 7));
            }
            memcpy(cut + at, d + starts[k], ends[k] - starts[k]);
            at += ends[k] - starts[k];
        }
    cut[at++] = 0xFF;
    cut[at++] = 0xD9;
    *length = at;
    return cut;
}

/* Scaled pixels kept around the rectangle in a cut: the chroma upsampling reads a neighbour up to a chroma sample
 * away, which spans up to 4 output pixels (a sampling factor of 4); tested exhaustively on small images. */
#define CUT_MARGIN 4

/* The cut of a restart_every_mcu JPEG that holds the scaled rectangle with CUT_MARGIN pixels more on each side
 * (malloc'd), and where the cut begins in the scaled image; NULL for any other file, which is then decoded as it
 * is. Called without the GIL. */
static unsigned char *cut_around(const unsigned char *d, size_t n, int eighths, int top, int left, int height,
                                 int width, size_t *length, unsigned *row_offset, unsigned *column_offset) {
    struct layout layout = {0};
    if (!read_layout(d, n, &layout))
        return NULL;
    unsigned scaled_height = (layout.height * eighths + 7) / 8, scaled_width = (layout.width * eighths + 7) / 8;
    if ((unsigned)top + (unsigned)height > scaled_height || (unsigned)left + (unsigned)width > scaled_width)
        return NULL; /* the whole decode says what is wrong */
    unsigned per_row = (layout.width + layout.mcu_width - 1) / layout.mcu_width;
    unsigned rows = (layout.height + layout.mcu_height - 1) / layout.mcu_height;
    size_t count = (size_t)per_row * rows;
    if (count > n / 3) /* each MCU takes a byte and its marker two: a header that claims more is not this file's */
        return NULL;
    size_t *starts = malloc(2 * count * sizeof *starts);
    if (!starts)
        return NULL;
    unsigned char *cut = NULL;
    if (find_mcus(d, n, layout.scan, starts, starts + count, count)) {
        unsigned mcu_height = layout.mcu_height * eighths / 8, mcu_width = layout.mcu_width * eighths / 8;
        unsigned first_row = top > CUT_MARGIN ? (unsigned)(top - CUT_MARGIN) / mcu_height : 0;
        unsigned first_column = left > CUT_MARGIN ? (unsigned)(left - CUT_MARGIN) / mcu_width : 0;
        unsigned end_row = ((unsigned)(top + height) + CUT_MARGIN - 1) / mcu_height + 1;
        unsigned end_column = ((unsigned)(left + width) + CUT_MARGIN - 1) / mcu_width + 1;
        end_row = end_row < rows ? end_row : rows;
        end_column = end_column < per_row ? end_column : per_row;
        cut = cut_mcus(d, &layout, starts, starts + count, per_row, first_row, end_row, first_column, end_column,
                       length);
        *row_offset = first_row * mcu_height;
        *column_offset = first_column * mcu_width;
    }
    free(starts);
    return cut;
}

/* Whether jpeg_crop_scanline gives the whole decode's columns: not where a component is both enlarged by the
 * scaled inverse DCT and still upsampled horizontally (4:1:0 at a reduced scale: libjpeg-turbo 2.1.5 then sizes
 * that component's cropped row without the enlargement and reads memory it never wrote). */
static int crop_is_exact(const struct jpeg_decompress_struct *info) {
    for (int k = 0; k < info->num_components; k++) {
        const jpeg_component_info *component = &info->comp_info[k];
        int enlarged = component->DCT_scaled_size != info->min_DCT_scaled_size;
        int upsampled = info->max_h_samp_factor * info->min_DCT_scaled_size !=
                        component->h_samp_factor * component->DCT_scaled_size;
        if (enlarged && upsampled)
            return 0;
    }
    return 1;
}

/* Reads `height` rows into `out` (rows of `width` RGB pixels) from the decoder's current row, then with `to_end`
 * the rows below as entropy data only; a short file is an error through `failure`. */
static void read_rows(struct jpeg_decompress_struct *info, struct failure *failure, unsigned char *out, int height,
                      JDIMENSION width, int to_end) {
    for (int row = 0; row < height;) {
        JSAMPROW line = out + (size_t)row * width * 3;
        JDIMENSION got = jpeg_read_scanlines(info, &line, 1);
        if (got == 0)
            end_too_soon(failure);
        row += (int)got;
    }
    /* With to_end, the rows below are entropy-decoded too (no IDCT, no colour conversion), to the end marker:
     * damage there (a zeroed stretch, a cut) refuses the file as the whole decode does, whatever the crop, and
     * libjpeg reports a zeroed stretch only there. Without, the decode stops here (a file that decoded whole
     * before: 0.74 -> 0.59 ms for a centred half-size box of an ImageNet-like photo). */
    JDIMENSION rest = to_end ? info->output_height - info->output_scanline : 0;
    if (rest > 0) {
        /* All but the last row: skipping to the very end would mark the image done without decoding it. */
        if (rest > 1 && jpeg_skip_scanlines(info, rest - 1) != rest - 1)
            end_too_soon(failure);
        JSAMPARRAY last = (*info->mem->alloc_sarray)((j_common_ptr)info, JPOOL_IMAGE, width * 3, 1);
        if (jpeg_read_scanlines(info, last, 1) != 1)
            end_too_soon(failure);
    }
}

/* The decode set up as simplejpeg's (TurboJPEG's defaults: ISLOW DCT, fancy upsampling, RGB out) at `eighths`/8. */
static void start_scaled(struct jpeg_decompress_struct *info, const unsigned char *source, size_t length,
                         int eighths) {
    jpeg_mem_src(info, source, (unsigned long)length);
    jpeg_read_header(info, TRUE);
    info->scale_num = (unsigned int)eighths;
    info->scale_denom = 8;
    info->out_color_space = JCS_RGB;
    info->dct_method = JDCT_ISLOW;
    info->do_fancy_upsampling = TRUE;
    jpeg_start_decompress(info);
}

/* The columns decoded: narrowed to the iMCU grid around *left..*left + *width where that is exact, else all. */
static void narrow_columns(struct jpeg_decompress_struct *info, JDIMENSION *left, JDIMENSION *width) {
    if (*width < info->output_width && crop_is_exact(info)) {
        jpeg_crop_scanline(info, left, width);
    } else {
        *left = 0;
        *width = info->output_width;
    }
}

/* The rectangle asked of decode, in the image scaled by eighths/8. */
struct rectangle {
    int eighths, top, left, height, width, to_end;
};

static void check_inside(const struct jpeg_decompress_struct *info, struct failure *failure,
                         const struct rectangle *r) {
    if ((unsigned long)r->top + (unsigned long)r->height > info->output_height ||
        (unsigned long)r->left + (unsigned long)r->width > info->output_width) {
        snprintf(failure->message, sizeof failure->message, "rectangle outside the %ux%u scaled image",
                 info->output_width, info->output_height);
        longjmp(failure->jump, 1);
    }
}

/* The rectangle's rows into `out` (rows of `width` RGB pixels), the rows above skipped; then the decode ended. */
static void read_rectangle(struct jpeg_decompress_struct *info, struct failure *failure, unsigned char *out,
                           const struct rectangle *r, JDIMENSION width) {
    if (r->top > 0 && jpeg_skip_scanlines(info, (JDIMENSION)r->top) != (JDIMENSION)r->top)
        end_too_soon(failure);
    read_rows(info, failure, out, r->height, width, r->to_end);
    if (r->to_end)
        jpeg_finish_decompress(info);
    else
        jpeg_abort_decompress(info);
}

/* decode's result for a checked rectangle of `data`: (pixels, left_decoded, width_decoded), or NULL with an
 * exception set. The GIL is released but to make the pixels' bytes object. */
static PyObject *decode_rectangle(const unsigned char *data, size_t length, struct rectangle r) {
    unsigned row_offset = 0, column_offset = 0;
    unsigned char *volatile cut = NULL;
    PyThreadState *volatile state = PyEval_SaveThread();
    if (!r.to_end)
        cut = cut_around(data, length, r.eighths, r.top, r.left, r.height, r.width, &length, &row_offset,
                         &column_offset);
    r.top -= (int)row_offset;
    r.left -= (int)column_offset;
    struct jpeg_decompress_struct info;
    struct failure failure;
    PyObject *volatile pixels = NULL;
    memset(&info, 0, sizeof info);
    info.err = errors_to(&failure);
    if (setjmp(failure.jump)) {
        jpeg_destroy_decompress(&info);
        if (state) PyEval_RestoreThread(state);
        free(cut);
        Py_XDECREF(pixels);
        PyErr_SetString(PyExc_ValueError, failure.message);
        return NULL;
    }
    jpeg_create_decompress(&info);
    start_scaled(&info, cut ? cut : data, length, r.eighths);
    check_inside(&info, &failure, &r);
    JDIMENSION left_decoded = (JDIMENSION)r.left, width_decoded = (JDIMENSION)r.width;
    narrow_columns(&info, &left_decoded, &width_decoded);
    PyEval_RestoreThread(state);
    state = NULL;
    pixels = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)r.height * width_decoded * 3);
    if (!pixels) {
        jpeg_destroy_decompress(&info);
        free(cut);
        return NULL;
    }
    state = PyEval_SaveThread();
    read_rectangle(&info, &failure, (unsigned char *)PyBytes_AS_STRING(pixels), &r, width_decoded);
    jpeg_destroy_decompress(&info);
    free(cut);
    PyEval_RestoreThread(state);
    state = NULL;
    PyObject *result = Py_BuildValue("(Oii)", pixels, (int)(left_decoded + column_offset), (int)width_decoded);
    Py_DECREF(pixels);
    return result;
}

static PyObject *decode(PyObject *self, PyObject *args) {
    Py_buffer data;
    struct rectangle r = {.to_end = 1};
    if (!PyArg_ParseTuple(args, "y*iiiii|p", &data, &r.eighths, &r.top, &r.left, &r.height, &r.width, &r.to_end))
        return NULL;
    PyObject *result = NULL;
    if (r.eighths < 1 || r.eighths > 8 || r.top < 0 || r.left < 0 || r.height < 1 || r.width < 1)
        PyErr_SetString(PyExc_ValueError, "scale must be 1-8 eighths and the rectangle non-empty");
    else
        result = decode_rectangle(data.buf, (size_t)data.len, r);
    PyBuffer_Release(&data);
    return result;
}

/* A destination the rewrite owns (jpeg_mem_dest frees its own buffers as it grows them and tells where the last
 * one is only at the end, so after an error it could not be freed without freeing one twice). */
struct growing {
    struct jpeg_destination_mgr manager;
    unsigned char *buffer;
    size_t size;
};

static void start_growing(j_compress_ptr info) {
    struct growing *growing = (struct growing *)info->dest;
    growing->manager.next_output_byte = growing->buffer;
    growing->manager.free_in_buffer = growing->size;
}

static boolean grow(j_compress_ptr info) {
    struct growing *growing = (struct growing *)info->dest;
    unsigned char *larger = realloc(growing->buffer, 2 * growing->size);
    if (!larger)
        ERREXIT1(info, JERR_OUT_OF_MEMORY, 0);
    growing->buffer = larger;
    growing->manager.next_output_byte = larger + growing->size;
    growing->manager.free_in_buffer = growing->size;
    growing->size *= 2;
    return TRUE;
}

static void stop_growing(j_compress_ptr info) { (void)info; }

/* Whether a progressive file's scans left any coefficient's low bits unsent: libjpeg then smooths the blocks it
 * decodes (a baseline rewrite would not), so the rewrite would change pixels. */
static int refinement_incomplete(const struct jpeg_decompress_struct *in) {
    if (!in->progressive_mode)
        return 0;
    for (int k = 0; k < in->num_components; k++)
        for (int coefficient = 0; coefficient < DCTSIZE2; coefficient++)
            if (in->coef_bits[k][coefficient] != 0)
                return 1;
    return 0;
}

/* `coefficients` written into `growing` with a restart marker after every MCU, as baseline with optimized tables. A
 * single component's sampling factors, which mean nothing for it, are written 1x1, so its MCU is one block (a
 * greyscale file that declared 2x2 would be rewritten but never cut). */
static void write_with_restarts(struct jpeg_decompress_struct *in, struct jpeg_compress_struct *out,
                                jvirt_barray_ptr *coefficients, struct growing *growing) {
    growing->manager.init_destination = start_growing;
    growing->manager.empty_output_buffer = grow;
    growing->manager.term_destination = stop_growing;
    out->dest = &growing->manager;
    jpeg_copy_critical_parameters(in, out);
    if (out->num_components == 1)
        out->comp_info[0].h_samp_factor = out->comp_info[0].v_samp_factor = 1;
    out->optimize_coding = TRUE;
    out->restart_interval = 1;
    jpeg_write_coefficients(out, coefficients);
    jpeg_finish_compress(out);
}

/* Whether restart_every_mcu rewrites a file of this colour space: YCbCr or greyscale (CMYK and YCCK are kept). */
static int rewrite_applies(const struct jpeg_decompress_struct *in) {
    return (in->jpeg_color_space == JCS_YCbCr && in->num_components == 3) ||
           (in->jpeg_color_space == JCS_GRAYSCALE && in->num_components == 1);
}

/* What `growing` holds as bytes (the rewrite) where it applied, else None; NULL with an exception set. */
static PyObject *written_or_none(const struct growing *growing, int applies) {
    if (applies)
        return PyBytes_FromStringAndSize((const char *)growing->buffer,
                                         (Py_ssize_t)(growing->size - growing->manager.free_in_buffer));
    Py_RETURN_NONE;
}

/* restart_every_mcu's result for `data`; `growing` (calloc'd) is freed here. The GIL is released but to make
 * the result. */
static PyObject *rewrite(const unsigned char *data, size_t length, struct growing *growing) {
    struct jpeg_decompress_struct in;
    struct jpeg_compress_struct out;
    struct failure failure;
    volatile int writing = 0;
    memset(&in, 0, sizeof in);
    memset(&out, 0, sizeof out);
    in.err = out.err = errors_to(&failure);
    PyThreadState *volatile state = PyEval_SaveThread();
    if (setjmp(failure.jump)) {
        if (writing) jpeg_destroy_compress(&out);
        jpeg_destroy_decompress(&in);
        PyEval_RestoreThread(state);
        free(growing->buffer);
        free(growing);
        PyErr_SetString(PyExc_ValueError, failure.message);
        return NULL;
    }
    jpeg_create_decompress(&in);
    jpeg_mem_src(&in, data, (unsigned long)length);
    jpeg_read_header(&in, TRUE);
    int applies = rewrite_applies(&in);
    jvirt_barray_ptr *coefficients = applies ? jpeg_read_coefficients(&in) : NULL;
    applies = applies && !refinement_incomplete(&in);
    if (applies) {
        growing->size = length + 65536;
        growing->buffer = malloc(growing->size);
        if (!growing->buffer)
            ERREXIT1(&in, JERR_OUT_OF_MEMORY, 0);
        jpeg_create_compress(&out);
        writing = 1;
        write_with_restarts(&in, &out, coefficients, growing);
        jpeg_finish_decompress(&in);
    }
    if (writing) jpeg_destroy_compress(&out);
    jpeg_destroy_decompress(&in);
    PyEval_RestoreThread(state);
    PyObject *result = written_or_none(growing, applies);
    free(growing->buffer);
    free(growing);
    return result;
}

static PyObject *restart_every_mcu(PyObject *self, PyObject *args) {
    Py_buffer data;
    if (!PyArg_ParseTuple(args, "y*", &data))
        return NULL;
    struct growing *growing = calloc(1, sizeof *growing); /* not a local: the error path reads what libjpeg grew */
    PyObject *result = growing ? rewrite(data.buf, (size_t)data.len, growing) : PyErr_NoMemory();
    PyBuffer_Release(&data);
    return result;
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS,
     "decode(data, scale_num, top, left, height, width, to_end=1) -> (rgb bytes, left_decoded, width_decoded)"},
    {"restart_every_mcu", restart_every_mcu, METH_VARARGS,
     "restart_every_mcu(data) -> the same coefficients as a JPEG with a restart marker after each MCU, or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_jpegcrop", NULL, -1, methods};

PyMODINIT_FUNC PyInit__jpegcrop(void) { return PyModule_Create(&module); }
