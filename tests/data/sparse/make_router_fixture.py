"""Makes the inference-free sparse fixture: a SparseEncoder whose Router sends queries to a
SparseStaticEmbedding (random weights over the tiny BERT family tokenizer) and documents to the
tiny MLM + SpladePooling of tests/data/sparse/bert-mlm (max, relu), saved with SparseEncoder.save,
and what `encode_query` and `encode_document` give for a set of texts.

Run ONCE, in a throwaway environment with torch and sentence-transformers 6.3 (never in CI):

    .venv/bin/python -c "from pathlib import Path; from worker.families.sparse import sparse_fixture_folder; \\
        print(sparse_fixture_folder(Path('tests/data/sparse/bert-mlm'), Path('/tmp/bertmlm'), \\
        families=Path('tests/data/families'), variant='max-relu'))"
    /tmp/refenv/bin/python tests/data/sparse/make_router_fixture.py /tmp/bertmlm/bert-mlm-max-relu

It writes tests/data/sparse/router-bert/ (the saved folder: router_config.json, query_0_
SparseStaticEmbedding/ and document_0_MLMTransformer/ + document_1_SpladePooling/; the query
tokenizer's model_max_length is 12, so long texts are cut) and router-bert-reference.npz (texts,
and each route's rows in CSR form: float32 values, int32 indices ascending, int64 offsets).
"""

from __future__ import annotations

import json
import platform
import shutil
import sys
from pathlib import Path

import numpy as np
import sentence_transformers
import torch
import transformers
from sentence_transformers import SparseEncoder
from sentence_transformers.sparse_encoder.modules import SparseStaticEmbedding
from sentence_transformers.base.modules import Router
from transformers import PreTrainedTokenizerFast

HERE = Path(__file__).resolve().parent
DATA = HERE.parent
OUT = HERE / "router-bert"
TEXTS = ["running shoes", "a", "a a a the the", "how to fix a flat bicycle tyre on the road without any tools at all",
         "東京 ラーメン", "Zürich café öffnungszeiten", "x y z", "", "weather", "[UNK] [PAD] [CLS]",
         "best laptop 2024 for students under 500 dollars with long battery life and a good screen"]


def csr(rows: list[torch.Tensor]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    idx, val, off = [], [], [0]
    for r in rows:
        d = r.to_dense().numpy().astype(np.float32)
        nz = np.flatnonzero(d)
        idx.append(nz.astype(np.int32))
        val.append(d[nz])
        off.append(off[-1] + len(nz))
    return np.concatenate(idx), np.concatenate(val), np.array(off, dtype=np.int64)


def main(mlm_folder: str) -> None:
    torch.manual_seed(59)
    texts = TEXTS + [line.split("\t")[-1].strip() for line in
                     (DATA / "terabyte05-300.tsv").read_text(encoding="utf-8").splitlines()[:60] if line.strip()]
    mlm = SparseEncoder(mlm_folder, device="cpu")
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(DATA / "families/bert/tokenizer.json"),
                                        unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
                                        mask_token="[MASK]", model_max_length=12)
    vocab = len(tokenizer.get_vocab())
    weight = torch.rand(vocab) * 3.0
    weight[torch.rand(vocab) < 0.1] = 0.0  # some tokens weigh nothing: they leave no entry
    query = SparseStaticEmbedding(tokenizer=tokenizer, weight=weight, frozen=True)
    router = Router.for_query_document(query_modules=[query], document_modules=[mlm[0], mlm[1]])
    model = SparseEncoder(modules=[router], device="cpu")
    if OUT.exists():
        shutil.rmtree(OUT)
    model.save(str(OUT))
    loaded = SparseEncoder(str(OUT), device="cpu")
    q = loaded.encode_query(texts, batch_size=7, convert_to_tensor=False)
    d = loaded.encode_document(texts, batch_size=7, convert_to_tensor=False)
    qi, qv, qo = csr(q)
    di, dv, do = csr(d)
    np.savez_compressed(HERE / "router-bert-reference.npz", texts=np.array(texts), query_indices=qi,
                        query_values=qv, query_offsets=qo, document_indices=di, document_values=dv,
                        document_offsets=do)
    versions = json.loads((HERE / "versions.json").read_text())
    versions["router"] = {"python": platform.python_version(), "torch": torch.__version__,
                          "transformers": transformers.__version__,
                          "sentence_transformers": sentence_transformers.__version__,
                          "command": "python tests/data/sparse/make_router_fixture.py <bert-mlm max-relu folder>",
                          "rows": len(texts), "query_nnz": int(qo[-1]), "document_nnz": int(do[-1]),
                          "modules": repr(loaded)}
    (HERE / "versions.json").write_text(json.dumps(versions, indent=1, ensure_ascii=False) + "\n")
    print(repr(loaded), len(texts), qo[-1], do[-1])


if __name__ == "__main__":
    main(sys.argv[1])
