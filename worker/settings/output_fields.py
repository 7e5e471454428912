"""The output_fields setting: renames, drops, a UUID of the query ID and constant fields of the
JSON output record, parsed once (at settings time, so a bad item fails the start) and applied
to every record by the output codec (worker/formats/messages.py).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

# The fields of the JSON output record (schemas/output.schema.json), for output_fields; `uuid`
# is written only when output_fields names it: the query ID as a UUID (uuid5 in UUID_NAMESPACE),
# for stores whose point IDs must be UUIDs (Qdrant, Weaviate).
OUTPUT_FIELDS = ("id", "embedding", "encoding", "dim", "model", "tokens", "truncated", "int8_range", "prompt_name",
                 "normalized", "fingerprint")
UUID_FIELD = "uuid"
UUID_NAMESPACE = uuid.NAMESPACE_URL  # uuid.uuid5(uuid.NAMESPACE_URL, query_id)


@dataclass(frozen=True)
class FieldMap:
    """output_fields, parsed: renames and drops of the record's fields, the query ID as a UUID
    under a name, and constant string fields added at the end."""

    renames: tuple[tuple[str, str | None], ...] = ()  # (field, new name, or None to drop it)
    uuid_name: str | None = None
    constants: tuple[tuple[str, str], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.renames or self.uuid_name or self.constants)


def parse_output_fields(items: tuple[str, ...] | list[str]) -> FieldMap:
    """output_fields items: `field=new_name` renames a field, `-field` drops it, `uuid=name` adds the
    query ID as a UUID under that name, `+name=value` adds a constant string field.

    Raises ValueError naming the item when a field is unknown, named twice, or two fields of the
    record would end up with one name.
    """
    renames: list[tuple[str, str | None]] = []
    constants: list[tuple[str, str]] = []
    uuid_name: str | None = None
    for item in items:
        item = item.strip()
        if item.startswith("+"):
            name, sep, value = item[1:].partition("=")
            if not sep or not name.strip():
                raise ValueError(f"{item!r}: expected +name=value (a constant field)")
            constants.append((name.strip(), value.strip()))
            continue
        if item.startswith("-"):
            name, new = item[1:].strip(), None
        elif "=" in item:
            name, _, new_name = item.partition("=")
            name, new = name.strip(), new_name.strip()
            if not new:
                raise ValueError(f"{item!r}: the new name is empty (write -{name} to drop the field)")
        else:
            raise ValueError(f"{item!r}: expected field=new_name (rename), -field (drop) or +name=value (constant)")
        if name == UUID_FIELD and new is not None:
            if uuid_name is not None:
                raise ValueError(f"{item!r}: field {name!r} is named twice")
            uuid_name = new
            continue
        if name not in OUTPUT_FIELDS:
            raise ValueError(f"{item!r}: {name!r} is not an output field (one of {', '.join(OUTPUT_FIELDS)}, or "
                             f"{UUID_FIELD}=name)")
        if any(name == seen for seen, _ in renames):
            raise ValueError(f"{item!r}: field {name!r} is named twice")
        renames.append((name, new))
    mapping = dict(renames)
    kept = [mapping.get(f, f) for f in OUTPUT_FIELDS if mapping.get(f, f) is not None]
    kept += [uuid_name] if uuid_name else []
    kept += [name for name, _ in constants]
    clash = sorted({n for n in kept if kept.count(n) > 1})
    if clash:
        raise ValueError(f"two output fields would be named {clash[0]!r}")
    return FieldMap(tuple(renames), uuid_name, tuple(constants))


def apply_output_fields(record: dict[str, object], fields: FieldMap) -> dict[str, object]:
    """The record with output_fields applied: renames and drops in the record's order, then the
    UUID field, then the constants."""
    mapping = dict(fields.renames)
    out: dict[str, object] = {}
    for name, value in record.items():
        new = mapping.get(name, name)
        if new is not None:
            out[new] = value
    if fields.uuid_name:
        out[fields.uuid_name] = str(uuid.uuid5(UUID_NAMESPACE, str(record["id"])))
    for name, value in fields.constants:
        out[name] = value
    return out
