"""Micro-batches a user's script brings (`toolkit.api.initialize`), in the Hugging Face convention: checked on
every rank, agreed across the job before any collective of the step, and turned into dsmt's token rows.

The HF convention (what a causal-LM collator yields and `model(**batch)` takes):
  input_ids       [micro_batch_size, seq_length] integer token ids
  labels          the same shape; -100 where a token has no loss; HF shifts inside the model (the logits at t
                  predict labels[t + 1]), and so does dsmt
  attention_mask  optional, 1 for tokens and 0 for right padding (labels -100 there, as HF's collators set them)
  position_ids    optional, restarting at 0 at each packed record (DataCollatorWithFlattening): the records of a
                  row then attend only to themselves (toolkit/adapters/packed.py)
dsmt's rows (toolkit/data/batches.py) carry the shifted labels: labels[t] = HF labels[t + 1], loss_mask 0 where
that is -100, and nothing at the last position.

A bad micro-batch on one rank must not leave the others waiting in a collective: every rank checks its own, then
one small all-gather tells every rank what every other found (and whether the ranks of one model replica, which
must read the same micro-batches, did), so all raise the same error or none does.
"""

from __future__ import annotations

import dataclasses

import torch

from toolkit.errors import DsmtError

IGNORE_INDEX = -100
KEYS = ("input_ids", "labels", "attention_mask", "position_ids")
INTEGER_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchRules:
    """What every micro-batch of the run must be."""

    micro_batch_size: int
    seq_length: int
    vocab_size: int
    packing_refusal: str | None = None  # why this layout cannot take packed records (None: it can)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.micro_batch_size, self.seq_length)


def micro_batch_problems(batch, *, index: int, rules: BatchRules) -> list[str]:
    """Everything wrong with micro-batch `index` (empty when it is fine). A mapping too odd to check may raise:
    `take_micro_batches` turns that into a problem too."""
    where = f"micro-batch {index}"
    if not hasattr(batch, "keys") or not hasattr(batch, "__getitem__"):
        return [f"micro_batch_type: {where} is a {type(batch).__name__}, not a mapping of tensors (input_ids, "
                "labels, ...)"]
    keys = set(batch.keys())
    problems = [f"micro_batch_keys: {where} lacks {name!r}" for name in ("input_ids", "labels") if name not in keys]
    unknown = sorted(str(key) for key in keys - set(KEYS))
    if unknown:
        problems.append(f"micro_batch_keys: {where} has keys {unknown} dsmt does not read; the keys are "
                        f"{list(KEYS)} (drop the others, e.g. token_type_ids)")
    for name in sorted(keys & set(KEYS)):
        problems += _tensor_problems(batch[name], name=name, where=where, rules=rules)
    if problems:
        return problems
    devices = {name: str(batch[name].device) for name in sorted(keys)}
    if len(set(devices.values())) > 1:
        return [f"micro_batch_device: {where} has tensors on different devices {devices}; put them on one"]
    return _value_problems(batch, where=where, rules=rules) + _position_problems(batch, where=where, rules=rules)


def _tensor_problems(value, *, name: str, where: str, rules: BatchRules) -> list[str]:
    if not isinstance(value, torch.Tensor):
        return [f"micro_batch_type: {where}: {name} is a {type(value).__name__}, not a torch.Tensor"]
    problems = []
    if tuple(value.shape) != rules.shape:
        problems.append(f"micro_batch_shape: {where}: {name} has shape {list(value.shape)}, the run takes "
                        "[micro_batch_size, "
                        f"seq_length] = {list(rules.shape)} (training.micro_batch_size, training.seq_length; pad "
                        "shorter rows on the right with labels -100)")
    allowed = INTEGER_DTYPES + ((torch.bool,) if name == "attention_mask" else ())
    if value.dtype not in allowed:
        problems.append(f"micro_batch_dtype: {where}: {name} has dtype {value.dtype}, not an integer dtype "
                        "(torch.long)")
    return problems


def _value_problems(batch, *, where: str, rules: BatchRules) -> list[str]:
    problems = []
    input_ids, labels = batch["input_ids"].long(), batch["labels"].long()
    bad = (input_ids < 0) | (input_ids >= rules.vocab_size)
    if bad.any():
        problems.append(f"token_ids_vocab: {where}: input_ids holds {_some(input_ids[bad])} outside the vocabulary "
                        f"[0, {rules.vocab_size}) (config.vocab_size): tokenise with the model's tokenizer")
    bad = ((labels < 0) | (labels >= rules.vocab_size)) & (labels != IGNORE_INDEX)
    if bad.any():
        problems.append(f"labels_vocab: {where}: labels holds {_some(labels[bad])} outside the vocabulary "
                        f"[0, {rules.vocab_size}) "
                        f"and not {IGNORE_INDEX} (HF's 'no loss' label)")
    if "attention_mask" in batch:
        mask = batch["attention_mask"].long()
        if ((mask != 0) & (mask != 1)).any():
            odd = mask[(mask != 0) & (mask != 1)]
            problems.append(f"attention_mask_values: {where}: attention_mask holds {_some(odd)}; "
                            "it takes 1 (token) and 0 (padding) only")
        elif (mask[:, 1:] > mask[:, :-1]).any():  # a 1 after a 0: padding on the left or inside the row
            problems.append(f"attention_mask_padding: {where}: attention_mask has padding (0) before tokens (1); "
                            "dsmt takes right padding (tokenizer.padding_side = 'right'), or packed records with "
                            "position_ids")
        elif ((mask == 0) & (labels != IGNORE_INDEX)).any():
            problems.append(f"padding_labels: {where}: labels are not {IGNORE_INDEX} where attention_mask is 0 "
                            "(padding); set them to -100, as HF's collators do")
    return problems


def _position_problems(batch, *, where: str, rules: BatchRules) -> list[str]:
    """position_ids count 0, 1, 2, ... within each record: every row starts a record (0) and each next position is
    0 (a new packed record) or the previous + 1. Offsets (a row starting at 512) are not taken: RoPE would read
    them as 0 .. s-1."""
    if "position_ids" not in batch:
        return []
    positions = batch["position_ids"].long()
    steps_ok = (positions[:, 1:] == 0) | (positions[:, 1:] == positions[:, :-1] + 1)
    if (positions[:, 0] != 0).any() or not steps_ok.all():
        row = int(((positions[:, 0] != 0) | ~steps_ok.all(dim=1)).nonzero()[0])
        return [f"position_ids_form: {where}: position_ids row {row} is {positions[row, :8].tolist()}...; each "
                "row must count 0, 1, 2, ... and restart at 0 where a packed record starts (as HF's "
                "DataCollatorWithFlattening writes them)"]
    if rules.packing_refusal and (positions[:, 1:] == 0).any():
        return [f"packed_layout: {where}: position_ids restart inside a row (packed records), but "
                f"{rules.packing_refusal}"]
    return []


def _some(values: torch.Tensor) -> str:
    shown = sorted(set(values.flatten()[:1000].tolist()))
    return ", ".join(map(str, shown[:5])) + (", ..." if len(shown) > 5 else "")


def to_token_rows(batch) -> dict[str, torch.Tensor]:
    """A checked HF micro-batch as dsmt's token row (see the module docstring), on the device the batch is on (a
    script may hand over CUDA tensors; the engine moves CPU ones)."""
    tokens = batch["input_ids"].long()
    rows, length = tokens.shape
    labels = batch["labels"].long()
    last = torch.full((rows, 1), IGNORE_INDEX, dtype=torch.long, device=labels.device)
    shifted = torch.cat([labels[:, 1:], last], dim=1)
    counted = shifted != IGNORE_INDEX
    position_ids = batch.get("position_ids")
    if position_ids is None:
        position_ids = torch.arange(length, device=tokens.device).expand(rows, length)
    return {"tokens": tokens, "position_ids": position_ids.long().contiguous(),
            "labels": shifted.masked_fill(~counted, 0), "loss_mask": counted.float()}


def padding_rows(rules: BatchRules) -> dict[str, torch.Tensor]:
    """A micro-batch that adds nothing to a loss (loss_mask 0): what evaluation pads a short rank with."""
    return to_token_rows({"input_ids": torch.zeros(rules.shape, dtype=torch.long),
                          "labels": torch.full(rules.shape, IGNORE_INDEX, dtype=torch.long)})


def read_micro_batch(batch, *, index: int, rules: BatchRules) -> tuple[dict | None, list[str]]:
    """(token rows or None, problems) of one HF micro-batch."""
    found = micro_batch_problems(batch, index=index, rules=rules)
    return (None if found else to_token_rows(batch)), found


def take_micro_batches(micro_batches, *, count: int | None, rules: BatchRules,
                       read=read_micro_batch) -> tuple[list[dict], list[str]]:
    """(token rows, problems): `count` micro-batches pulled from the iterable `micro_batches` (None: all of it),
    each checked and turned into rows by `read` (DPO's pairs: toolkit/train/engine/hf_pairs.py); never raises, so
    that `agree` can tell every rank."""
    if count is not None and isinstance(micro_batches, (list, tuple)) and len(micro_batches) != count:
        return [], [f"micro_batch_count: got a {type(micro_batches).__name__} of {len(micro_batches)} micro-batches; "
                    f"one optimizer step takes {count} per data-parallel rank (run.micro_batches_per_step)"]
    try:
        iterator = iter(micro_batches)
    except TypeError:
        return [], [f"micro_batch_type: micro_batches is a {type(micro_batches).__name__}, not an iterable of "
                    "micro-batches"]
    rows: list[dict] = []
    problems: list[str] = []
    index = 0
    while count is None or index < count:
        try:
            batch = next(iterator)
        except StopIteration:
            if count is not None:
                problems.append(f"micro_batch_count: the micro-batch iterator ended after {index}; one optimizer "
                                f"step takes {count} per data-parallel rank (run.micro_batches_per_step = global "
                                "batch / (micro_batch_size x dp))")
            break
        except Exception as err:  # the user's iterator failed: every rank must hear of it
            problems.append(f"micro_batch_iterator: the micro-batch iterator raised {type(err).__name__}: {err}")
            break
        try:
            row, found = read(batch, index=index, rules=rules)
            if row is not None:
                rows.append(row)
        except Exception as err:  # a check that could not run on this input is a problem too, never a lone raise
            found = [f"micro_batch_type: micro-batch {index} could not be read: {type(err).__name__}: {err}"]
        problems += found
        index += 1
    return rows, problems


def fingerprint(rows: list[dict]) -> int:
    """An int64 hash of the micro-batches' tokens, labels, mask and positions (equal rows, equal hash)."""
    total = torch.zeros((), dtype=torch.int64)
    for number, row in enumerate(rows):
        for slot, key in enumerate(("tokens", "labels", "loss_mask", "position_ids")):
            flat = row[key].long().flatten().cpu()  # a few thousand ids per micro-batch
            weights = torch.arange(1, flat.numel() + 1, dtype=torch.int64) * (2 * (4 * number + slot) + 1)
            total += (flat * weights + flat).sum()  # int64 arithmetic wraps: a hash, not a sum
    return int(total)


def agree(*, problems: list[str], rows: list[dict], dp_rank: int, what: str, device) -> list[int]:
    """Collective over the whole job: every rank's problems (raised as one DsmtError on every rank when any rank
    has one), then that the ranks of each data-parallel replica hold the same micro-batches. Returns every
    rank's micro-batch count."""
    import torch.distributed as dist

    mine = torch.tensor([1 if problems else 0, dp_rank, fingerprint(rows) if not problems else 0, len(rows)],
                        dtype=torch.int64, device=device)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    table = [row.cpu().tolist() for row in gathered]
    if any(flag for flag, *_ in table):
        reports: list = [None] * len(table)
        dist.all_gather_object(reports, problems[:MAX_PROBLEMS_PER_RANK])
        raise DsmtError(f"{what}: bad micro-batches on {_rank_list([r for r, found in enumerate(reports) if found])}, "
                        "raised on every rank (nothing was computed for this step):\n" + _merged(reports))
    _require_same_within_replicas(table, what=what)
    return [count for *_, count in table]


MAX_PROBLEMS_PER_RANK = 5
MAX_LINES = 20


def _merged(reports: list[list[str] | None]) -> str:
    """One line per distinct problem with the ranks that have it (a thousand ranks with one wrong seq_length make
    one line), at most MAX_LINES."""
    ranks_of: dict[str, list[int]] = {}
    for rank, found in enumerate(reports):
        for problem in found or ():
            ranks_of.setdefault(problem, []).append(rank)
    lines = [f"  {_rank_list(ranks)}: {problem}" for problem, ranks in ranks_of.items()]
    more = [f"  ... and {len(lines) - MAX_LINES} more"] if len(lines) > MAX_LINES else []
    return "\n".join(lines[:MAX_LINES] + more)


def _rank_list(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8])) + (f", ... ({len(ranks)} ranks)" if len(ranks) > 8 else "")
    return f"rank {shown}" if len(ranks) == 1 else f"ranks {shown}"


def _require_same_within_replicas(table: list[list[int]], *, what: str) -> None:
    by_replica: dict[int, dict[tuple[int, int], list[int]]] = {}
    for rank, (_, dp_rank, digest, count) in enumerate(table):
        by_replica.setdefault(dp_rank, {}).setdefault((digest, count), []).append(rank)
    for dp_rank, variants in sorted(by_replica.items()):
        if len(variants) > 1:
            groups = " vs ".join(str(ranks) for ranks in variants.values())
            raise DsmtError(f"replica_batches: {what}: ranks {groups} hold shards of the same model replica "
                            f"(dp_rank {dp_rank}: its "
                            "tensor / pipeline / context-parallel ranks) but passed different micro-batches; every "
                            "rank of a replica must pass the same ones: choose them by run.dp_rank and "
                            "run.dp_size, not by the global rank")
