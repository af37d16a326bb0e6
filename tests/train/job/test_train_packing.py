"""Packed records (data.packing) give megatron the loss of each record alone: packed == unpacked == HF per record.

One 4-rank gloo launch (this file is its per-rank worker: `torchrun ... test_train_packing.py PLAN.json`) runs, for
each layout (TP2 x PP2 with megatron's 1F1B schedule; TP2 with sequence parallelism x DP2) and each model (the
tiny Llama: RoPE at the record positions, toolkit/adapters/packed.py; the tiny GPT-2: learned positions; a Mistral
with a sliding window of 8 tokens: the window within each record, toolkit/adapters/window.py) and
dataset (short text documents plus one longer than a row, split; prompt/completion records), megatron's
forward-only schedule over every row of the examples, packed and unpacked, through the training task's
`CausalLM.forward` / `loss_sum`, and sums the token losses over all ranks. The test process computes the same
per-token mean with HF, one forward per record (tests/train/reference.py, which tokenises the data itself).

The pure tests at the end check the mask, the THD parameters for Transformer Engine (mocked: no TE here) and the
refusals.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

MICRO = 2  # rows per micro-batch: the block-diagonal mask is per row
SEQ = {"text": 128, "sft": 128}  # several records share a row; the tiny GPT-2 has 128 learned positions
LAYOUTS = {"tp2-pp2": dict(tp=2, pp=2, dp=1), "tp2-sp-dp2": dict(tp=2, pp=1, dp=2, sp=True)}
# Measured (fp32, 2 CPU cores, per-token means ~5.5): packed - unpacked <= 1.7e-7, packed - HF <= 1.9e-7
# (`pytest -s` prints them), well inside the 1e-4 asked of packing; the tolerances are tighter so that the control
# (packed rows without the mask: records see their predecessors) lands outside them: measured 3.8e-5 (the random
# tiny GPT-2 barely reads its context) to 2.4e-3.
PACKED_VS_UNPACKED = 1e-6
VS_HF = 1e-6
CONTROL_MINIMUM = 1e-5


# --- the per-rank worker ----------------------------------------------------------------------------------------

def megatron_loss_sum(*, chunks, examples, vocab_size: int, unmasked: bool = False) -> tuple[float, int]:
    """(sum of the counted token losses of every row, counted tokens) over all ranks, forward only. `unmasked`:
    the control, packed rows with megatron's plain causal attention (records see their predecessors)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from toolkit.train.engine.tasks import CausalLM

    task = CausalLM(vocab_size=vocab_size)
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    rows = list(range(len(examples)))
    rows += [-1] * (-len(rows) % (MICRO * dp_size))  # -1: a copy of row 0 whose labels do not count
    rows = rows[dp_rank::dp_size]
    batches = []
    for start in range(0, len(rows), MICRO):
        chosen = torch.tensor(rows[start:start + MICRO])
        ids = examples.token_ids[chosen.clamp(min=0)]
        batches.append({"tokens": ids[:, :-1], "labels": ids[:, 1:], "position_ids": examples.positions(
            chosen.clamp(min=0)), "loss_mask": examples.loss_mask[chosen.clamp(min=0)] * (chosen >= 0)[:, None]})
    sums = []

    def forward_step(iterator, model):
        batch = next(iterator)

        def loss_func(output):
            token_sum = task.loss_sum(output, batch)
            sums.append(float(token_sum))
            return token_sum, {}

        if unmasked:
            return model(batch["tokens"], batch["position_ids"], None), loss_func
        return task.forward(model, batch), loss_func

    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(batches), model=chunks[0],
                                num_microbatches=len(batches), seq_length=examples.seq_length,
                                micro_batch_size=MICRO, forward_only=True)
    counts = parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0
    total = torch.tensor([sum(sums) if counts else 0.0], dtype=torch.float64)
    dist.all_reduce(total)
    counted = sum(float(b["loss_mask"].sum()) for b in batches)
    counted_all = torch.tensor([counted if counts else 0.0], dtype=torch.float64)
    dist.all_reduce(counted_all)
    return total.item(), int(counted_all.item())


def worker(plan_path: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from toolkit import backend as backends
    from toolkit.data import build_examples
    from toolkit.parallel.layout import Layout
    from toolkit.convert.chunks import load_model_chunks
    from toolkit.parallel.groups import init_process_groups
    from toolkit.spec.schema import DataSpec

    plan = json.loads(Path(plan_path).read_text())
    dist.init_process_group("gloo")
    figures = {}
    for layout_name, options in LAYOUTS.items():
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        layout = Layout(**options)
        init_process_groups(layout=layout, dist_backend="gloo")
        for model_name, checkpoint in plan["models"].items():
            backends.current().seed(7)
            chunks, info = load_model_chunks(checkpoint=Path(checkpoint), layout=layout, params_dtype=torch.float32)
            for chunk in chunks:
                chunk.eval()
            for data_name, fields in plan["data"].items():
                for packing in (True, False):
                    examples = build_examples(data=DataSpec(**fields, packing=packing), model_path=checkpoint,
                                              seq_length=SEQ[data_name], vocab_size=info.settings.vocab_size, seed=0)
                    with torch.no_grad():
                        total, counted = megatron_loss_sum(chunks=chunks, examples=examples,
                                                           vocab_size=info.settings.vocab_size)
                    figures[f"{layout_name} {model_name} {data_name} {'packed' if packing else 'unpacked'}"] = {
                        "loss_sum": total, "tokens": counted, "rows": len(examples),
                        "boundaries": int((examples.positions(torch.arange(len(examples)))[:, 1:] == 0).sum())}
                    if packing:
                        with torch.no_grad():
                            total, counted = megatron_loss_sum(chunks=chunks, examples=examples, unmasked=True,
                                                               vocab_size=info.settings.vocab_size)
                        figures[f"{layout_name} {model_name} {data_name} control"] = {"loss_sum": total,
                                                                                      "tokens": counted}
    if dist.get_rank() == 0:
        Path(plan["results"]).write_text(json.dumps(figures))
    dist.barrier()


# --- the launch and what the tests check ------------------------------------------------------------------------

def short_documents(path: Path) -> Path:
    """Sentences of the shipped stories as documents (10-60 tokens), and one document of five stories (~800
    tokens, split into pieces of seq_length + 1 = 129)."""
    from train_helpers import STORIES

    stories = [json.loads(line)["text"] for line in STORIES.read_text().splitlines()[:12]]
    documents = [sentence.strip() + "." for story in stories for sentence in story.split(".") if sentence.strip()]
    documents.insert(7, " ".join(stories[:5]))
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    return path


def hf_per_record_mean(*, checkpoint: Path, data: dict, seq_length: int) -> tuple[float, int, int]:
    """(per-token mean, counted tokens, records) from HF, one forward per record (reference.py's rules)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from reference import RunSettings, count_tokens, document_loss_sum, read_jsonl, tokenize_records

    settings = RunSettings(model_dir=checkpoint, data_path=Path(data["path"]), text_field="text",
                           prompt_field=data.get("prompt_field"), completion_field=data.get("completion_field"),
                           shuffle=False, seq_length=seq_length, global_batch_size=1, micro_batch_size=1, lr=0.0,
                           min_lr=0.0, lr_schedule="constant", warmup_steps=0, weight_decay=0.0, betas=(0.9, 0.95),
                           eps=1e-8, grad_clip=0.0, train_steps=0, seed=0, packing=False)
    rows = tokenize_records(records=read_jsonl(settings.data_path),
                            tokenizer=AutoTokenizer.from_pretrained(checkpoint), settings=settings)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        total = sum(float(document_loss_sum(model, record)) for row in rows for record in row)
    return total / count_tokens(rows), count_tokens(rows), len(rows)


@pytest.fixture(scope="module")
def packing_figures(tmp_path_factory):
    from ranks import run_on_ranks
    from train_helpers import PROMPTS

    from toolkit.models.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("packing")
    models = {"llama": str(make_tiny_checkpoint(root / "llama")),
              "gpt2": str(make_tiny_checkpoint(root / "gpt2", model_type="gpt2", seed=9)),
              # a sliding window shorter than the records: megatron's window and the packed mask, combined
              "mistral-window": str(make_tiny_checkpoint(root / "mistral", model_type="mistral", sliding_window=8,
                                                         seed=2))}
    data = {"text": {"path": str(short_documents(root / "documents.jsonl"))},
            "sft": {"path": str(PROMPTS), "prompt_field": "prompt", "completion_field": "completion"}}
    plan = root / "plan.json"
    plan.write_text(json.dumps({"models": models, "data": data, "results": str(root / "results.json")}))
    run_on_ranks(__file__, plan, nprocs=4)
    hf = {(m, d): hf_per_record_mean(checkpoint=Path(models[m]), data=data[d], seq_length=SEQ[d])
          for m in models for d in data}
    return json.loads((root / "results.json").read_text()), hf


@pytest.mark.multiproc
def test_packed_loss_equals_unpacked_and_hf_per_record(packing_figures):
    figures, hf = packing_figures
    for layout in LAYOUTS:
        for (model, data), (hf_mean, hf_tokens, hf_records) in hf.items():
            packed, unpacked, control = (figures[f"{layout} {model} {data} {kind}"]
                                         for kind in ("packed", "unpacked", "control"))
            packed_mean, unpacked_mean, control_mean = (f["loss_sum"] / f["tokens"]
                                                        for f in (packed, unpacked, control))
            print(f"\n{layout:<11}{model:<15}{data:<5} rows packed {packed['rows']} (boundaries "
                  f"{packed['boundaries']}) / unpacked {unpacked['rows']}, tokens {packed['tokens']}: mean packed "
                  f"{packed_mean:.7f} unpacked {unpacked_mean:.7f} HF {hf_mean:.7f} | packed-unpacked "
                  f"{abs(packed_mean - unpacked_mean):.1e} packed-HF {abs(packed_mean - hf_mean):.1e} | control "
                  f"(no mask) - HF {abs(control_mean - hf_mean):.1e}")
            assert packed["tokens"] == unpacked["tokens"] == hf_tokens
            assert unpacked["rows"] == hf_records and packed["rows"] < unpacked["rows"]
            assert packed["boundaries"] > packed["rows"]  # rows really hold several records
            assert abs(packed_mean - unpacked_mean) <= PACKED_VS_UNPACKED
            assert abs(packed_mean - hf_mean) <= VS_HF and abs(unpacked_mean - hf_mean) <= VS_HF
            assert abs(control_mean - hf_mean) > CONTROL_MINIMUM  # the comparison sees attention across records


# --- pure checks (one process) ----------------------------------------------------------------------------------

def test_mask_is_block_diagonal_and_causal():
    from toolkit.adapters.packed import has_packed_boundary, packed_attention_mask

    positions = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])
    mask = packed_attention_mask(positions)
    assert mask.shape == (2, 1, 6, 6) and mask.dtype == torch.bool  # True = masked (megatron's convention)
    allowed = (~mask[0, 0]).int().tolist()
    assert allowed == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                       [0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 1]]
    assert torch.equal(~mask[1, 0], torch.ones(6, 6, dtype=torch.bool).tril())
    assert has_packed_boundary(positions) and not has_packed_boundary(positions[1:])


class RecordingModel(torch.nn.Module):
    """Stands in for a GPTModel with Transformer Engine attention: records its call, returns [1, b*s, v] logits."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def forward(self, tokens, position_ids, attention_mask, packed_seq_params=None):
        self.calls.append((tokens, position_ids, attention_mask, packed_seq_params))
        return torch.arange(tokens.numel() * 3, dtype=torch.float32).view(1, tokens.numel(), 3)


def test_fused_attention_gets_thd_packed_seq_params(monkeypatch):
    from megatron.core import parallel_state

    from toolkit.adapters import packed
    from toolkit.train.engine.tasks import CausalLM

    monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: 1)
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(packed, "uses_thd", lambda model: True)
    model = RecordingModel()
    positions = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]])
    tokens = torch.arange(10).view(2, 5)
    logits = CausalLM(vocab_size=3).forward(model, {"tokens": tokens, "position_ids": positions})
    (flat_tokens, flat_positions, mask, params), = model.calls
    assert flat_tokens.tolist() == [list(range(10))] and flat_positions.tolist() == [positions.flatten().tolist()]
    assert mask is None and params.qkv_format == "thd"
    assert params.cu_seqlens_q.dtype == torch.int32 and params.cu_seqlens_q.tolist() == [0, 3, 5, 7, 10]
    assert torch.equal(params.cu_seqlens_kv, params.cu_seqlens_q) and params.max_seqlen_q == params.max_seqlen_kv == 3
    assert logits.shape == (2, 5, 3) and logits[1, 0, 0] == 15  # back to [b, s, v] for the labels as they are
    # a micro-batch without a boundary takes the plain bshd call
    CausalLM(vocab_size=3).forward(model, {"tokens": tokens, "position_ids": torch.arange(5).expand(2, 5)})
    assert model.calls[-1][3] is None and model.calls[-1][0].shape == (2, 5)


def test_packing_refuses_context_parallel_and_thd_rows_at_pp(monkeypatch):
    from megatron.core import parallel_state

    from toolkit.adapters import packed
    from toolkit.errors import DsmtError
    from toolkit.train.engine.tasks import CausalLM

    batch = {"tokens": torch.zeros(2, 4, dtype=torch.long), "position_ids": torch.tensor([[0, 1, 0, 1]] * 2)}
    monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: 2)
    with pytest.raises(DsmtError, match=r"data.packing=true with parallel.cp=2.*data.packing: false"):
        CausalLM(vocab_size=3).forward(RecordingModel(), batch)
    monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: 1)
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(packed, "uses_thd", lambda model: True)
    with pytest.raises(DsmtError, match=r"pp=2 and micro_batch_size=2.*micro_batch_size: 1"):
        CausalLM(vocab_size=3).forward(RecordingModel(), batch)


def test_dsmt_check_refuses_packing_with_cp_and_thd_micro_batches_at_pp():
    from toolkit.check.checks import check_packing
    from toolkit.spec.schema import JobSpec

    def rules(**sections) -> list[str]:
        raw = {"model": {"builtin": "llama3-8b"}, "training": {"global_batch_size": 64, "attention": "fused"},
               "data": {"path": "corpus.jsonl"}}
        for section, values in sections.items():
            raw[section] = {**raw.get(section, {}), **values}
        return [p.rule for p in check_packing(spec=JobSpec.model_validate(raw), shape=None)]

    assert rules(parallel={"cp": 2}) == ["packing_context_parallel"]
    assert rules(parallel={"pp": 2}, training={"micro_batch_size": 2}) == ["packing_fused_micro_batch"]
    assert rules(parallel={"pp": 2}, training={"micro_batch_size": 1}) == []  # one THD row per micro-batch
    assert rules(parallel={"pp": 1}, training={"micro_batch_size": 4}) == []  # flattened to one row
    assert rules(training={"precision": "fp32"}) == ["packing_fused_fp32"]  # TE has no fp32 THD attention
    assert rules(training={"precision": "fp32", "attention": "local"}) == []
    assert rules(parallel={"cp": 2}, data={"packing": False}) == []
    assert rules(parallel={"cp": 2}, data={"path": None, "synthetic": True}) == []


def test_rotary_wrapper_gathers_record_positions():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from toolkit import backend as backends
    from toolkit.adapters.packed import PositionRotary

    backends.current()  # megatron's rotary asks for a CUDA device: the CPU redirections
    inner = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)
    wrapper = PositionRotary(inner)
    assert torch.equal(wrapper(6), inner(6))  # no positions: megatron's own
    wrapper.position_ids = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])
    emb = wrapper(6)
    table = inner(6)
    assert emb.shape == (6, 2, 1, 8)
    assert torch.equal(emb[:, 1], table[:, 0]) and torch.equal(emb[3, 0, 0], table[0, 0, 0])
    assert torch.equal(emb[4, 0, 0], table[1, 0, 0]) and wrapper.get_rotary_seq_len is not None
    assert torch.equal(wrapper(6, packed_seq=True), inner(6, packed_seq=True))  # THD: megatron's per-sequence RoPE


if __name__ == "__main__":
    worker(sys.argv[1])


def test_packed_rope_table_is_as_long_as_the_longest_record_known_on_the_host():
    """The packed call's RoPE table has the longest record's length (HF's max(position_ids) + 1, by which Phi-3's
    long-RoPE picks its factors), handed in from the host (no positions.max() on the device), and only inside."""
    from toolkit.adapters.packed import PositionRotary, longest_record

    asked = []

    class Inner(torch.nn.Module):
        def forward(self, max_seq_len, offset=0, packed_seq=False, cp_group=None):
            asked.append(max_seq_len)
            return torch.arange(max_seq_len, dtype=torch.float32).view(-1, 1, 1, 1)

    model = torch.nn.Module()
    model.rotary_pos_emb = rotary = PositionRotary(Inner())
    rotary.position_ids = torch.tensor([[0, 1, 2, 0, 1, 0]])
    with longest_record(model, 3):
        freqs = rotary(6)
    assert asked == [3] and freqs[:, 0, 0, 0].tolist() == [0, 1, 2, 0, 1, 0]
    assert rotary.longest_record is None
    rotary(6)
    assert asked[-1] == 6  # without it: the row's length, which holds every position too
