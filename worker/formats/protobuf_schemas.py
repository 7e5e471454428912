"""The Protobuf messages of the registry formats, built at run time (no protoc, no generated code).

confluent-kafka's Protobuf serdes need a message class. The worker's are made here from a field
table with protobuf's own descriptor API, in a descriptor pool of their own; the .proto files in
worker/formats/registry_schemas/ (schemas/registry/) are `proto_source` of the same tables, and a test
keeps them equal. Input is read with the Keyword message: any writer message whose fields 1 and
2 are the strings id and text decodes (Protobuf reads by field number).
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

PACKAGE = "dev.keyword_embedder"
_F = descriptor_pb2.FieldDescriptorProto

# name, number, type, repeated (a TYPE_MESSAGE field's type is the message's one nested type, NESTED)
Field = tuple[str, int, int, bool]
_TAIL: list[Field] = [("encoding", 3, _F.TYPE_STRING, False), ("dim", 4, _F.TYPE_INT32, False),
                      ("model", 5, _F.TYPE_STRING, False), ("tokens", 6, _F.TYPE_INT32, False),
                      ("truncated", 7, _F.TYPE_BOOL, False), ("int8_range", 8, _F.TYPE_DOUBLE, True),
                      ("prompt_name", 9, _F.TYPE_STRING, False), ("fingerprint", 10, _F.TYPE_STRING, False)]
# Fields added after a schema's first registered version: a message without them is that version
# (what a registry that has only it matches; worker/formats/schema_registry.py falls back to it).
ADDED_FIELDS = ("fingerprint",)
MESSAGES: dict[str, tuple[str, list[Field]]] = {
    "keyword": ("Keyword", [("id", 1, _F.TYPE_STRING, False), ("text", 2, _F.TYPE_STRING, False)]),
    "embedding-floats": ("Embedding", [("id", 1, _F.TYPE_STRING, False), ("embedding", 2, _F.TYPE_FLOAT, True),
                                       *_TAIL]),
    "embedding-bytes": ("Embedding", [("id", 1, _F.TYPE_STRING, False), ("embedding", 2, _F.TYPE_BYTES, False),
                                      *_TAIL]),
    # A sparse model's record: the dense record's numbers for the fields they share (8, int8_range,
    # is not one), the embedding a nested {indices, values}, the optional terms after them.
    "sparse-embedding": ("SparseEmbedding", [("id", 1, _F.TYPE_STRING, False), ("embedding", 2, _F.TYPE_MESSAGE, False),
                                             *(f for f in _TAIL if f[0] != "int8_range"),
                                             ("terms", 11, _F.TYPE_STRING, True)]),
}
# The nested message of a schema's TYPE_MESSAGE field: (its name, its fields).
NESTED: dict[str, tuple[str, list[Field]]] = {
    "sparse-embedding": ("SparseVector", [("indices", 1, _F.TYPE_INT32, True), ("values", 2, _F.TYPE_FLOAT, True)]),
}
_TYPE_NAMES = {_F.TYPE_STRING: "string", _F.TYPE_FLOAT: "float", _F.TYPE_DOUBLE: "double", _F.TYPE_BYTES: "bytes",
               _F.TYPE_INT32: "int32", _F.TYPE_BOOL: "bool"}


def file_descriptor_proto(schema: str, *, without: tuple[str, ...] = ()) -> descriptor_pb2.FileDescriptorProto:
    message, fields = MESSAGES[schema]
    fields = [f for f in fields if f[0] not in without]
    fdp = descriptor_pb2.FileDescriptorProto(name=f"keyword_embedder/{schema}.proto", package=PACKAGE,
                                             syntax="proto3")
    msg = fdp.message_type.add(name=message)
    if schema in NESTED:
        nested_name, nested_fields = NESTED[schema]
        nested = msg.nested_type.add(name=nested_name)
        for name, number, kind, repeated in nested_fields:
            nested.field.add(name=name, number=number, type=kind,
                             label=_F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL)
    for name, number, kind, repeated in fields:
        added = msg.field.add(name=name, number=number, type=kind,
                              label=_F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL)
        if kind == _F.TYPE_MESSAGE:
            added.type_name = f".{PACKAGE}.{message}.{NESTED[schema][0]}"
    return fdp


def message_class(schema: str, *, without: tuple[str, ...] = ()) -> Any:
    """The generated-at-run-time message class of one schema (a pool of its own per call);
    `without` leaves fields out (ADDED_FIELDS: the schema's previous version)."""
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file_descriptor_proto(schema, without=without))
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{PACKAGE}.{MESSAGES[schema][0]}"))


def proto_source(schema: str, *, without: tuple[str, ...] = ()) -> str:
    """The .proto text of a schema (what worker/formats/registry_schemas/<schema>.proto holds);
    `without` as in message_class."""
    message, fields = MESSAGES[schema]
    fields = [f for f in fields if f[0] not in without]
    lines = ['syntax = "proto3";', "", f"package {PACKAGE};", "", f"message {message} {{"]
    if schema in NESTED:
        nested_name, nested_fields = NESTED[schema]
        lines.append(f"  message {nested_name} {{")
        for name, number, kind, repeated in nested_fields:
            lines.append(f"    {'repeated ' if repeated else ''}{_TYPE_NAMES[kind]} {name} = {number};")
        lines += ["  }", ""]
    for name, number, kind, repeated in fields:
        type_name = NESTED[schema][0] if kind == _F.TYPE_MESSAGE else _TYPE_NAMES[kind]
        lines.append(f"  {'repeated ' if repeated else ''}{type_name} {name} = {number};")
    return "\n".join([*lines, "}", ""])
