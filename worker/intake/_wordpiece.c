/* The WordPiece fast path's loop over a poll's texts, compiled (worker/intake/wordpiece.py).

   It does exactly what FastWordPiece.encode does for each text, with the same word cache, so that
   the poll thread spends a fraction of a microsecond per keyword where the interpreter spent about
   three (a regular expression, a translate, a lower, a list and a lookup per word):

       ASCII only, no added token's text (compared lowercased: both are ASCII)
       -> drop NUL and control characters; tab, newline and return become spaces; lowercase
       -> words: runs of letters and digits, and each other printable character alone
       -> each word's IDs from the cache (a dict word -> tuple of IDs); a word not there is asked of
          `miss` (WordCache.miss: the model's own WordPiece, counted and kept)
       -> first, the words' IDs, last; cut to max_len (last kept)

   A text it does not take (not ASCII, or holding an added token) gets None, and the caller runs
   the full tokenizer on it. tests/unit/worker/intake/test_wordpiece.py holds this against the Python path and the
   full tokenizer.

   Runs with the GIL held (it reads and writes Python objects throughout); the poll thread only,
   like the cache it shares. No state of its own. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* What the cleaning does to an ASCII byte: 0 drop, 1 space, 2 letter or digit, 3 punctuation. */
enum { DROP = 0, SPACE = 1, ALNUM = 2, PUNCT = 3 };

static unsigned char char_class(unsigned char c) {
    if (c == '\t' || c == '\n' || c == '\r' || c == ' ') return SPACE;
    if (c < 0x20 || c == 0x7f) return DROP;
    if ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) return ALNUM;
    return PUNCT; /* every other printable ASCII character is punctuation to BERT */
}

static unsigned char lower(unsigned char c) { return (c >= 'A' && c <= 'Z') ? (unsigned char)(c + 32) : c; }

/* Whether the raw text holds any added token's text, case ignored (both ASCII). */
static int holds_added(const unsigned char *text, Py_ssize_t n, PyObject *added) {
    Py_ssize_t count = PyTuple_GET_SIZE(added);
    for (Py_ssize_t t = 0; t < count; t++) {
        PyObject *tok = PyTuple_GET_ITEM(added, t);
        const char *s = PyBytes_AS_STRING(tok);
        Py_ssize_t m = PyBytes_GET_SIZE(tok);
        if (m == 0) return 1; /* an empty pattern matches anywhere, as the regular expression does */
        for (Py_ssize_t i = 0; i + m <= n; i++) {
            Py_ssize_t j = 0;
            while (j < m && lower(text[i + j]) == (unsigned char)s[j]) j++;
            if (j == m) return 1;
        }
    }
    return 0;
}

/* Appends the word's IDs at out[*pos] (only while below `room`), counting every ID in *count.
   Returns 0, or -1 with an exception set. */
static int put_word(const char *word, Py_ssize_t len, PyObject *words, PyObject *miss, int64_t *out,
                    Py_ssize_t room, Py_ssize_t *pos, Py_ssize_t *count, Py_ssize_t *hits) {
    PyObject *key = PyUnicode_FromStringAndSize(word, len);
    if (key == NULL) return -1;
    PyObject *ids = PyDict_GetItemWithError(words, key); /* borrowed */
    if (ids != NULL) {
        Py_INCREF(ids);
        (*hits)++;
    } else if (PyErr_Occurred()) {
        Py_DECREF(key);
        return -1;
    } else {
        ids = PyObject_CallOneArg(miss, key); /* new reference */
        if (ids == NULL) {
            Py_DECREF(key);
            return -1;
        }
    }
    Py_DECREF(key);
    if (!PyTuple_Check(ids)) {
        PyErr_SetString(PyExc_TypeError, "a word's IDs must be a tuple of ints");
        Py_DECREF(ids);
        return -1;
    }
    Py_ssize_t k = PyTuple_GET_SIZE(ids);
    for (Py_ssize_t i = 0; i < k; i++) {
        if (*pos < room) {
            long long v = PyLong_AsLongLong(PyTuple_GET_ITEM(ids, i));
            if (v == -1 && PyErr_Occurred()) {
                Py_DECREF(ids);
                return -1;
            }
            out[(*pos)++] = (int64_t)v;
        }
    }
    *count += k;
    Py_DECREF(ids);
    return 0;
}

/* encode(texts, flat, words, miss, first, last, max_len, added)
   -> (list of an int64 view of `flat` or None per text, list of token counts before the cut or
   None, how many words the cache answered). `flat` is a writable 1-D int64 array with room for
   min(len(text) + 2, max_len) IDs per text (a word of k characters has at most k pieces). */
static PyObject *encode(PyObject *self, PyObject *args) {
    PyObject *texts, *flat, *words, *miss, *added;
    long long first, last;
    Py_ssize_t max_len;
    if (!PyArg_ParseTuple(args, "O!OO!OLLnO!", &PyList_Type, &texts, &flat, &PyDict_Type, &words, &miss,
                          &first, &last, &max_len, &PyTuple_Type, &added))
        return NULL;
    if (max_len < 3) {
        PyErr_SetString(PyExc_ValueError, "max_len must be at least 3");
        return NULL;
    }
    Py_ssize_t added_count = PyTuple_GET_SIZE(added);
    for (Py_ssize_t t = 0; t < added_count; t++) {
        if (!PyBytes_Check(PyTuple_GET_ITEM(added, t))) {
            PyErr_SetString(PyExc_TypeError, "added tokens must be lowercased ASCII bytes");
            return NULL;
        }
    }
    Py_buffer buf;
    if (PyObject_GetBuffer(flat, &buf, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_ND) < 0) return NULL;
    PyObject *views = NULL, *counts = NULL, *result = NULL, *text = NULL;
    char *scratch = NULL;
    const char *fmt = buf.format != NULL ? buf.format : "";
    if (*fmt == '@' || *fmt == '=' || *fmt == '<') fmt++; /* native order on the little-endian hosts we build for */
    if (buf.ndim != 1 || buf.itemsize != 8 || (strcmp(fmt, "q") != 0 && strcmp(fmt, "l") != 0)) {
        PyErr_SetString(PyExc_TypeError, "flat must be a 1-D int64 array");
        goto done;
    }
    int64_t *out = (int64_t *)buf.buf;
    Py_ssize_t capacity = buf.shape[0];
    views = PyList_New(0);
    counts = PyList_New(0);
    if (views == NULL || counts == NULL) goto done;
    Py_ssize_t at = 0, hits = 0, scratch_size = 0;
    /* `miss` is Python and may change `texts`. The texts taken are those in the list at the call
       (`flat` has room for those), as long as they stay in it: its length is read again each turn,
       and the text being split is held (its characters are read after each call) until its IDs
       are written. The Python loop does the same. */
    Py_ssize_t n_texts = PyList_GET_SIZE(texts);
    for (Py_ssize_t i = 0; i < n_texts; i++) { /* before any text is split: nothing is half done */
        if (!PyUnicode_Check(PyList_GET_ITEM(texts, i))) {
            PyErr_SetString(PyExc_TypeError, "texts must be str");
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i < n_texts && i < PyList_GET_SIZE(texts); i++) {
        Py_CLEAR(text);
        text = Py_NewRef(PyList_GET_ITEM(texts, i));
        if (!PyUnicode_Check(text)) {
            PyErr_SetString(PyExc_TypeError, "texts must be str");
            goto done;
        }
        const unsigned char *raw = (const unsigned char *)PyUnicode_DATA(text);
        Py_ssize_t n = PyUnicode_GET_LENGTH(text);
        if (!PyUnicode_IS_ASCII(text) || (added_count && holds_added(raw, n, added))) {
            if (PyList_Append(views, Py_None) < 0 || PyList_Append(counts, Py_None) < 0) goto done;
            continue;
        }
        Py_ssize_t room = n + 2 < max_len ? n + 2 : max_len;
        if (at + room > capacity) {
            PyErr_SetString(PyExc_ValueError, "flat is too small for these texts");
            goto done;
        }
        if (n > scratch_size) {
            char *grown = PyMem_Realloc(scratch, (size_t)n);
            if (grown == NULL) {
                PyErr_NoMemory();
                goto done;
            }
            scratch = grown;
            scratch_size = n;
        }
        int64_t *row = out + at;
        Py_ssize_t pos = 0, count = 0;
        /* Room for the words' IDs: max_len less [CLS] and [SEP]; counted beyond it, not written. */
        Py_ssize_t word_room = room - 1;
        row[pos++] = (int64_t)first;
        count = 1;
        Py_ssize_t len = 0; /* the letters and digits gathered into scratch so far */
        for (Py_ssize_t j = 0; j <= n; j++) {
            unsigned char c = j < n ? raw[j] : ' ';
            unsigned char kind = char_class(c);
            if (kind == DROP) continue; /* dropped before splitting: it joins its neighbours */
            if (kind == ALNUM) {
                scratch[len++] = (char)lower(c);
                continue;
            }
            if (len) {
                if (put_word(scratch, len, words, miss, row, word_room, &pos, &count, &hits) < 0) goto done;
                len = 0;
            }
            if (kind == PUNCT) {
                char p = (char)c;
                if (put_word(&p, 1, words, miss, row, word_room, &pos, &count, &hits) < 0) goto done;
            }
        }
        count += 1; /* [SEP] */
        if (pos > max_len - 1) pos = max_len - 1;
        row[pos++] = (int64_t)last;
        PyObject *lo = PyLong_FromSsize_t(at), *hi = PyLong_FromSsize_t(at + pos);
        PyObject *cut = (lo && hi) ? PySlice_New(lo, hi, NULL) : NULL;
        Py_XDECREF(lo);
        Py_XDECREF(hi);
        if (cut == NULL) goto done;
        PyObject *view = PyObject_GetItem(flat, cut);
        Py_DECREF(cut);
        if (view == NULL) goto done;
        int appended = PyList_Append(views, view);
        Py_DECREF(view);
        if (appended < 0) goto done;
        PyObject *total = PyLong_FromSsize_t(count);
        if (total == NULL) goto done;
        appended = PyList_Append(counts, total);
        Py_DECREF(total);
        if (appended < 0) goto done;
        at += pos;
    }
    result = Py_BuildValue("(OOn)", views, counts, hits);
done:
    Py_XDECREF(text);
    PyMem_Free(scratch);
    Py_XDECREF(views);
    Py_XDECREF(counts);
    PyBuffer_Release(&buf);
    return result;
}

static PyMethodDef methods[] = {
    {"encode", encode, METH_VARARGS,
     "encode(texts, flat, words, miss, first, last, max_len, added) -> (views, counts, hits)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_wordpiece", NULL, -1, methods};

PyMODINIT_FUNC PyInit__wordpiece(void) { return PyModule_Create(&module); }
