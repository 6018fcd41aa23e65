"""A complete artifact for a target + DSpark drafter: four graphs, the tokenizer and a manifest.

* ``target_aux.onnx``: the target step with the extra ``aux_hidden`` output (exporter/dspark_export.py);
* ``dspark_draft.onnx`` (manifest graph ``draft``), ``dspark_draft_sample.onnx`` (graph ``draft_sample``,
  MarkovSample for batches with sampled requests) and ``dspark_context.onnx`` (graph ``dspark_context``);
* ``manifest.json`` with ``draft.kind = "dspark"`` and ``draft.dspark`` (DsparkConfig.summary()).
  ``draft.max_draft`` is the drafter's block size N (all N drafts come from one pass; the budget solver
  verifies a prefix of them). Old readers see the usual sections; ``graphs.dspark_context`` is extra.

`dspark-trt export` calls this when ``--draft`` is a DSpark checkpoint (exporter/export.py), after the
shared argument checks; like the classic export it writes into a staging directory and moves it into
place, so a failed export never leaves a half-written artifact.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from dspark_trt.errors import DsparkError
from dspark_trt.manifest_schema import DSPARK_CONTEXT_GRAPH as CONTEXT_GRAPH
from dspark_trt.manifest_schema import DSPARK_SAMPLE_GRAPH


def export_dspark_artifact(target_dir, draft_dir, out_dir, *, max_batch: int = 8, max_context: int = 1024,
                           overwrite: bool = False, progress: bool = False, ort_flavour: str = "fused",
                           dtype: str = "fp32", external_data: str = "auto") -> Path:
    """ort_flavour "fused" also writes the ORT flavour (exporter/ort_flavour.py) of the target
    (`target_aux.ort.onnx`) and of the drafter's block-pass graphs (`dspark_draft.ort.onnx`,
    `dspark_draft_sample.ort.onnx`); the context graph has one form. external_data: as for classic
    artifacts (exporter/external_data.py: a graph's weights over 1 GiB go to `<file>.data` under auto)."""
    from tqdm import tqdm

    from dspark_trt.exporter.dspark_export import (CONTEXT_FILE, DECODE_FILE, DRAFT_FILE, SAMPLE_FILE, TARGET_FILE,
                                                   export_dspark, export_target_with_aux)
    from dspark_trt.exporter.export import _io, plan_dims
    from dspark_trt.exporter.greedy_twin import write_greedy_twins
    from dspark_trt.exporter.ort_flavour import check_flavour, export_ort_decode, ort_file, record_ort_graph
    from dspark_trt.exporter.tokenizer_files import tokenizer_facts
    from dspark_trt.exporter.external_data import use_external
    from dspark_trt.manifest import Manifest
    from dspark_trt.models.checkpoint import load_decoder
    from dspark_trt.models.dspark_drafter import load_dspark_drafter
    from dspark_trt.outputs import Staging, check_out_dir, replace_dir

    target_dir, draft_dir, out_dir = Path(target_dir), Path(draft_dir), Path(out_dir)
    check_flavour(ort_flavour)
    use_external(external_data, 0)  # a bad mode is refused before the models load
    check_out_dir(out_dir, "--out")
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise DsparkError(f"{out_dir} exists and is not empty; pass --force to overwrite it")
    tok_src = target_dir / "tokenizer.json"
    if not tok_src.is_file():
        raise DsparkError(f"no tokenizer.json in {target_dir}: the artifact needs the target's tokenizer")
    if max_batch < 2:
        raise DsparkError("--max-batch must be >= 2 for a DSpark artifact")
    bar = tqdm(total=5, desc="export", disable=not progress, unit="stage")
    bar.set_postfix_str("loading models")
    target = load_decoder(target_dir, dtype)
    if max_context > target.config.max_position_embeddings:
        raise DsparkError(f"--max-context {max_context} exceeds the target's max_position_embeddings "
                          f"{target.config.max_position_embeddings}")
    drafter = load_dspark_drafter(draft_dir, target_dir, dtype)
    cfg = drafter.cfg
    n = cfg.num_draft
    bar.update()
    staging = Staging(out_dir.parent, ".export-")
    tmp = staging.path
    try:
        bar.set_postfix_str(TARGET_FILE)
        written = export_target_with_aux(target, cfg.aux_layers, tmp / TARGET_FILE, num_slots=max_batch,
                                         external_data=external_data)
        fused = ort_flavour == "fused"
        target_ort = ort_file(Path(TARGET_FILE).stem)
        if fused:
            written += export_target_with_aux(target, cfg.aux_layers, tmp / target_ort, num_slots=max_batch,
                                              ort_fused_positions=max_context, external_data=external_data)
            written += export_ort_decode(target, tmp, target.lm_head.weight.dtype, target.config.vocab_size,
                                         max_context, external_data, cfg.aux_layers, DECODE_FILE)
        del target
        bar.update()
        bar.set_postfix_str("DSpark drafter graphs")
        drafter_files = export_dspark(drafter, tmp, num_slots=max_batch, sample=True,
                                      ort_fused_positions=max_context if fused else 0, external_data=external_data)
        for path in drafter_files.values():
            written += [f.name for f in (path, Path(f"{path}.data")) if f.is_file()]
        bar.update()
        bar.set_postfix_str("manifest")
        tokenizer = tokenizer_facts(target_dir)
        for name in tokenizer["files"]:
            shutil.copyfile(target_dir / name, tmp / name)
        dims, limits = plan_dims(max_batch, n, max_context)
        from dspark_trt.models.config import load_config

        tc, lc = load_config(target_dir), cfg.layers
        manifest = Manifest.create(
            model={"arch": tc.model_type, "vocab_size": tc.vocab_size, "hidden_size": tc.hidden_size,
                   "num_layers": tc.num_hidden_layers, "num_kv_heads": tc.num_key_value_heads,
                   "head_dim": tc.head_dim, "dtype": dtype, "max_context": max_context,
                   "num_attention_heads": tc.num_attention_heads, "intermediate_size": tc.intermediate_size},
            draft={"arch": lc.model_type, "hidden_size": lc.hidden_size, "num_layers": lc.num_hidden_layers,
                   "num_kv_heads": lc.num_key_value_heads, "head_dim": lc.head_dim, "max_draft": n,
                   "confidence": "head" if drafter.confidence_head is not None else "fallback",
                   "temperatures": [1.0] * n, "kind": "dspark", "dspark": cfg.summary()},
            limits=limits, dims=dims, tokenizer=tokenizer,
            graphs={"draft": {"file": DRAFT_FILE, **_io(tmp / DRAFT_FILE)},
                    "target": {"file": TARGET_FILE, **_io(tmp / TARGET_FILE)},
                    DSPARK_SAMPLE_GRAPH: {"file": SAMPLE_FILE, **_io(tmp / SAMPLE_FILE)},
                    CONTEXT_GRAPH: {"file": CONTEXT_FILE, **_io(tmp / CONTEXT_FILE)}})
        if fused:
            record_ort_graph(manifest["graphs"], "target", _io(tmp / target_ort), file=target_ort, decode=DECODE_FILE)
            written += write_greedy_twins(manifest["graphs"], tmp)
            for graph, key in (("draft", "draft_ort"), (DSPARK_SAMPLE_GRAPH, "sample_ort")):
                path = drafter_files[key]
                record_ort_graph(manifest["graphs"], graph, _io(path), file=path.name)
        manifest["sources"] = {"target": str(target_dir.resolve()), "draft": str(draft_dir.resolve()), "head": None}
        for name in (*written, *tokenizer["files"]):
            manifest.record_file(tmp, name)
        manifest.save(tmp)
        bar.update()
        replace_dir(tmp, out_dir)
        bar.update()
    finally:
        bar.close()
        staging.close()
    return out_dir
