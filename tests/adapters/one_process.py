"""Megatron-core against transformers in this one process (no launch): a gloo group of one at TP 1 seeded 0, a
checkpoint loaded into megatron in fp32 with full (gathered) logits and in eval mode, and transformers' own model of
the same checkpoint (fp32, eager attention), for the adapter tests that compare logits at TP 1 x PP 1."""

import contextlib

import torch


@contextlib.contextmanager
def one_process():
    """A gloo process group of one with megatron's model parallel state at TP 1, seeded 0."""
    from megatron.core import parallel_state

    from toolkit import backend as backends
    from toolkit.launch.local import single_process_group

    with single_process_group(dist_backend="gloo"):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        backends.current().seed(0)
        yield


def megatron_model(path):
    """The checkpoint at `path` as one fp32 megatron model in eval mode; call inside `one_process()`."""
    from toolkit.convert.chunks import load_model_chunks
    from toolkit.parallel.groups import Layout

    (model,), _ = load_model_chunks(checkpoint=path, layout=Layout(), params_dtype=torch.float32,
                                    parallel_output=False)
    return model.eval()


def rows(tokens: torch.Tensor) -> torch.Tensor:
    """Positions 0 .. s-1 for every row of `tokens` (b, s)."""
    return torch.arange(tokens.shape[1])[None].expand(tokens.shape[0], -1)


def megatron_logits(path, *, batches: list[tuple]) -> list[torch.Tensor]:
    """Megatron's logits (padded vocab) of each (tokens, positions, attention_mask) in `batches`, one model loaded
    once in `one_process()`."""
    with one_process():
        model = megatron_model(path)
        with torch.no_grad():
            return [model(tokens, positions, mask) for tokens, positions, mask in batches]


def hf_model(path):
    """transformers' model of the checkpoint at `path`: fp32, eager attention, eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def max_logit_gap(path, *, tokens: torch.Tensor, vocab: int = 250) -> float:
    """max |megatron - transformers| over the first `vocab` logits of `tokens` (rows from position 0)."""
    logits, = megatron_logits(path, batches=[(tokens, rows(tokens), None)])
    with torch.no_grad():
        reference = hf_model(path)(tokens).logits
    return (logits[..., :vocab] - reference).abs().max().item()


def packed_vs_alone_gap(path, *, lengths: tuple[int, ...], vocab: int = 250) -> float:
    """max |logits of records packed in one row (positions restarting, dsmt's packed mask) - logits of each record
    alone|, megatron both sides."""
    from toolkit.adapters.packed import packed_attention_mask

    torch.manual_seed(0)
    records = [torch.randint(3, vocab, (1, length)) for length in lengths]
    tokens = torch.cat(records, dim=1)
    positions = torch.cat([rows(record) for record in records], dim=1)
    batches = [(tokens, positions, packed_attention_mask(positions))] + [(r, rows(r), None) for r in records]
    packed, *alone = megatron_logits(path, batches=batches)
    return (packed[..., :vocab] - torch.cat(alone, dim=1)[..., :vocab]).abs().max().item()
