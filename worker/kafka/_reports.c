/* A produced record's delivery callback, compiled (worker/kafka/reports.py, `ReportSink`).

   librdkafka reports every record once, and confluent-kafka calls the record's callback with
   (err, msg) on the thread that polls the producer, taking the interpreter lock for each. In
   Python that callback was a closure made per record, which called the record's `on_delivered`
   in turn: two Python frames a record on the delivery thread, while the poll and output threads
   wait for the same lock. A `Report` does the same with no frame of its own:

       err is None -> the sink counts a delivery, then on_delivered() (for an embedding, a
                      partial of a list's append: C all the way down)
       err given   -> sink.refused(topic, err, on_failed): the producer decides (stop, or let
                      a wrapper take the record over)
       on_delivered raised an Exception -> sink.broken(topic, exc): the producer stops the
                      worker, visibly (anything else, such as KeyboardInterrupt, propagates)

   (A compiled produce loop over a batch's records sat here too, and was removed: through the broker
   it measured 1.028, 0.985-1.088, against the per-record loop, no resolved gain for its code;
   docs/performance.md.)

   The sink's count is read and reset by the delivery thread after each poll (`take_delivered`),
   so a poll with a delivery tells the failure policy once that the credentials work. Every
   call runs with the interpreter lock held; no state outside the objects. tests/unit/worker/kafka/test_reports.py
   holds this against the Python form in reports.py. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>

typedef struct {
    PyObject_HEAD
    PyObject *refused; /* (topic, err, on_failed) -> ignored */
    PyObject *broken;  /* (topic, exc) -> ignored */
    Py_ssize_t delivered;
} Sink;

typedef struct {
    PyObject_HEAD
    Sink *sink;
    PyObject *topic;
    PyObject *on_delivered;
    PyObject *on_failed;
    vectorcallfunc vectorcall;
} Report;

static PyTypeObject SinkType;
static PyTypeObject ReportType;

/* The exception being raised, taken out of the error indicator, normalized and with its
   traceback: a new reference, or NULL where there is none. PyErr_GetRaisedException is 3.12's;
   the worker runs on 3.11 too. */
static PyObject *take_raised(void) {
    PyObject *type, *exc, *tb;
    PyErr_Fetch(&type, &exc, &tb);
    PyErr_NormalizeException(&type, &exc, &tb);
    if (tb != NULL && exc != NULL) PyException_SetTraceback(exc, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return exc;
}

/* ------------------------------------------------------------------ Report */

/* Returns None (whatever the callee returned, as the Python form does), or NULL with the callee's
   exception. */
static PyObject *report_deliver(Report *self, PyObject *err) {
    Sink *sink = self->sink;
    PyObject *r;
    if (err != Py_None) {
        r = PyObject_CallFunctionObjArgs(sink->refused, self->topic, err, self->on_failed, NULL);
    } else {
        sink->delivered++;
        r = PyObject_CallNoArgs(self->on_delivered);
        if (r == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_Exception)) return NULL;
            PyObject *exc = take_raised();
            r = exc != NULL ? PyObject_CallFunctionObjArgs(sink->broken, self->topic, exc, NULL) : NULL;
            Py_XDECREF(exc);
        }
    }
    if (r == NULL) return NULL;
    Py_DECREF(r);
    Py_RETURN_NONE;
}

static PyObject *report_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    if (n != 2 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "a delivery report takes (err, msg)");
        return NULL;
    }
    return report_deliver((Report *)callable, args[0]);
}

static int report_traverse(Report *self, visitproc visit, void *arg) {
    Py_VISIT(self->sink);
    Py_VISIT(self->topic);
    Py_VISIT(self->on_delivered);
    Py_VISIT(self->on_failed);
    return 0;
}

static int report_clear(Report *self) {
    Py_CLEAR(self->sink);
    Py_CLEAR(self->topic);
    Py_CLEAR(self->on_delivered);
    Py_CLEAR(self->on_failed);
    return 0;
}

static void report_dealloc(Report *self) {
    PyObject_GC_UnTrack(self);
    report_clear(self);
    PyObject_GC_Del(self);
}

static PyTypeObject ReportType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "worker.kafka._reports.Report",
    .tp_basicsize = sizeof(Report),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(Report, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_traverse = (traverseproc)report_traverse,
    .tp_clear = (inquiry)report_clear,
    .tp_dealloc = (destructor)report_dealloc,
    .tp_doc = "One record's delivery callback: (err, msg) -> None. Made by Sink.report.",
};

/* ------------------------------------------------------------------ Sink */

static PyObject *sink_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *names[] = {"refused", "broken", NULL};
    PyObject *refused, *broken;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO", names, &refused, &broken)) return NULL;
    if (!PyCallable_Check(refused) || !PyCallable_Check(broken)) {
        PyErr_SetString(PyExc_TypeError, "refused and broken must be callable");
        return NULL;
    }
    Sink *self = (Sink *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->refused = Py_NewRef(refused);
    self->broken = Py_NewRef(broken);
    self->delivered = 0;
    return (PyObject *)self;
}

static PyObject *new_report(Sink *sink, PyObject *topic, PyObject *on_delivered, PyObject *on_failed) {
    Report *r = PyObject_GC_New(Report, &ReportType);
    if (r == NULL) return NULL;
    r->sink = (Sink *)Py_NewRef(sink);
    r->topic = Py_NewRef(topic);
    r->on_delivered = Py_NewRef(on_delivered);
    r->on_failed = Py_NewRef(on_failed);
    r->vectorcall = report_vectorcall;
    PyObject_GC_Track(r);
    return (PyObject *)r;
}

/* report(topic, on_delivered, on_failed) -> Report */
static PyObject *sink_report(Sink *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "report(topic, on_delivered, on_failed)");
        return NULL;
    }
    return new_report(self, args[0], args[1], args[2]);
}

static PyObject *sink_take_delivered(Sink *self, PyObject *Py_UNUSED(ignored)) {
    Py_ssize_t n = self->delivered;
    self->delivered = 0;
    return PyLong_FromSsize_t(n);
}

static int sink_traverse(Sink *self, visitproc visit, void *arg) {
    Py_VISIT(self->refused);
    Py_VISIT(self->broken);
    return 0;
}

static int sink_clear(Sink *self) {
    Py_CLEAR(self->refused);
    Py_CLEAR(self->broken);
    return 0;
}

static void sink_dealloc(Sink *self) {
    PyObject_GC_UnTrack(self);
    sink_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef sink_methods[] = {
    {"report", (PyCFunction)(void (*)(void))sink_report, METH_FASTCALL,
     "report(topic, on_delivered, on_failed) -> a record's delivery callback"},
    {"take_delivered", (PyCFunction)sink_take_delivered, METH_NOARGS,
     "Deliveries reported since the last call (and resets the count)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject SinkType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "worker.kafka._reports.Sink",
    .tp_basicsize = sizeof(Sink),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = sink_new,
    .tp_traverse = (traverseproc)sink_traverse,
    .tp_clear = (inquiry)sink_clear,
    .tp_dealloc = (destructor)sink_dealloc,
    .tp_methods = sink_methods,
    .tp_doc = "Sink(refused, broken): makes records' delivery callbacks and counts deliveries.",
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_reports",
    .m_doc = "Delivery callbacks without Python frames (worker/kafka/reports.py).",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__reports(void) {
    if (PyType_Ready(&SinkType) < 0 || PyType_Ready(&ReportType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "Sink", (PyObject *)&SinkType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
