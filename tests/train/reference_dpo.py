"""An independent one-process reference for `dsmt train` with training.method: dpo, simpo or orpo: plain HF
transformers (+ peft under training.lora) + torch, nothing from toolkit/. It reads the job spec YAML and the preference jsonl itself and
re-implements, from their written rules (the DPO design: records, tokenisation, truncation, loss, metrics), what a
dsmt DPO run should do, so a parity test against it can catch dsmt's bugs. The run settings, sample order, LR
schedule, clipping and AdamW conventions are reference.py's (imported, not changed).

  records    TRL's: strings {"prompt", "chosen", "rejected"}; conversational {"prompt": [msgs], "chosen": [msgs],
             "rejected": [msgs]}, or {"chosen": [msgs], "rejected": [msgs]} whose prompt is the longest common prefix
             of the two message lists (the rest of each is its completion).
  tokens     strings as SFT's prompt/completion: tokenizer(prompt) (its default specials) + tokenizer(completion,
             add_special_tokens=False) + EOS, labels on the completion and its EOS. Conversational: prompt + completion
             rendered as one chat (tokenizer.apply_chat_template(tokenize=False), or "<role>: <content>\\n" per message
             with EOS after a final assistant turn when the tokenizer has no chat_template), tokenised without
             specials; a token is a counted label when its first character lies in an assistant turn of the
             COMPLETION: the text between the conversation up to that turn rendered with add_generation_prompt=True
             and the conversation through that turn (the fallback's EOS counts after a final assistant turn). The
             prompt part (for truncation) is every token starting before the end of the prompt messages rendered
             with add_generation_prompt=True (False when the completion does not open with an assistant turn).
  truncation L = seq_length + 1. The prompt is cut from the LEFT (its last tokens kept), both sides by the same
             rule, then completions at the right (their first tokens kept); see `kept_lengths`. A pair cut in any
             way counts in num_truncated; one with a side without a counted label is dropped (num_dropped).
  log-probs  of a sequence: one HF forward of that sequence alone (positions from 0; what dsmt's block-diagonal
             packed attention gives), the sum over its counted labels t of log_softmax(logits[t - 1])[ids[t]].
             data.packing only changes the truncation rule.
  reference  the starting checkpoint, frozen, eval mode (full fine-tuning: a copy; LoRA: the same PeftModel under
             `disable_adapter()`), or the HF checkpoint at training.dpo.reference when that is a path;
             `precomputed` gives the same numbers as `base`. Computed once for all pairs, under no_grad.
  loss       TRL's per pair (`pair_losses`), averaged over the global batch's pairs (global_batch_size counts
             pairs); metrics (TRL names) are means over the same pairs, from this step's policy log-probs (before
             the optimizer step).
  order      reference.py's `global_sample_indices` over the N kept pairs (seed, data.shuffle).
  optimizer  full fine-tuning: reference.py's `adamw` (weight decay on matrices only); LoRA: AdamW over the
             trainable LoRA tensors with weight decay on all (reference_lora.py's); clipping and the LR schedule
             through reference.py's `clip_and_step`.
fp32 throughout; the policy stays in the eval mode HF loads it in (the tiny test models have no dropout).

SimPO and ORPO (training.method: simpo / orpo, settings under training.simpo / training.orpo) are reference-free:
the same records, tokens, truncation, order, optimizer, schedule and clipping, no reference model at all. With pi_c,
pi_r the policy's log-prob sums of a pair and n_c, n_r their counted labels, avg_s = pi_s / n_s:
  simpo      TRL CPOTrainer loss_type="simpo", cpo_alpha=0 (`simpo_pair_losses`): z = beta (avg_c - avg_r) - gamma,
             -(1 - eps) logsigmoid(z) - eps logsigmoid(-z) per pair, averaged over the global batch's pairs.
  orpo       TRL ORPOTrainer (`orpo_loss`): NLL - beta mean(logsigmoid(log_odds)) with log_odds = (avg_c - avg_r) -
             (log1p(-exp(avg_c)) - log1p(-exp(avg_r))) and NLL = -sum(pi_c) / sum(n_c), ONE token-level mean over
             the global batch's chosen completions (a micro-batch's part is -sum(its pi_c) / T, T the global batch's).
  metrics    rewards from the AVERAGED log-probs (beta avg_s); logps/* are the averages (`simpo_metrics`,
             `orpo_metrics`; ORPO adds nll_loss, log_odds_ratio, log_odds_chosen).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

from reference import RunSettings, adamw, clip_and_step, global_sample_indices, load_hf_model, read_jsonl, saved_state

METRIC_NAMES = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected")
SIMPO_METRIC_NAMES = METRIC_NAMES
ORPO_METRIC_NAMES = METRIC_NAMES + ("nll_loss", "log_odds_ratio", "log_odds_chosen")


@dataclass(frozen=True)
class DpoSettings:
    beta: float = 0.1
    loss: str = "sigmoid"
    label_smoothing: float = 0.0
    reference: str = "base"

    @classmethod
    def from_training(cls, training: dict) -> "DpoSettings":
        if training.get("method", "sft") != "dpo":
            raise ValueError(f"training.method={training.get('method', 'sft')!r}: the DPO reference needs method: dpo")
        dpo = training.get("dpo") or {}
        settings = cls(beta=float(dpo.get("beta", 0.1)), loss=dpo.get("loss", "sigmoid"),
                       label_smoothing=float(dpo.get("label_smoothing", 0.0)), reference=str(dpo.get("reference", "base")))
        if settings.loss not in ("sigmoid", "ipo", "hinge"):
            raise ValueError(f"unknown training.dpo.loss {settings.loss!r}")
        return settings


@dataclass(frozen=True)
class SimpoSettings:
    beta: float = 2.0
    gamma: float = 1.0
    label_smoothing: float = 0.0

    @classmethod
    def from_training(cls, training: dict) -> "SimpoSettings":
        if training.get("method", "sft") != "simpo":
            raise ValueError(f"training.method={training.get('method', 'sft')!r}: SimPO needs method: simpo")
        simpo = training.get("simpo") or {}
        return cls(beta=float(simpo.get("beta", 2.0)), gamma=float(simpo.get("gamma", 1.0)),
                   label_smoothing=float(simpo.get("label_smoothing", 0.0)))


@dataclass(frozen=True)
class OrpoSettings:
    beta: float = 0.1

    @classmethod
    def from_training(cls, training: dict) -> "OrpoSettings":
        if training.get("method", "sft") != "orpo":
            raise ValueError(f"training.method={training.get('method', 'sft')!r}: ORPO needs method: orpo")
        return cls(beta=float((training.get("orpo") or {}).get("beta", 0.1)))


def method_settings(training: dict) -> DpoSettings | SimpoSettings | OrpoSettings:
    """The preference method's settings, by training.method (dpo, simpo or orpo)."""
    method = training.get("method", "sft")
    kinds = {"dpo": DpoSettings, "simpo": SimpoSettings, "orpo": OrpoSettings}
    if method not in kinds:
        raise ValueError(f"training.method={method!r}: the preference reference needs dpo, simpo or orpo")
    return kinds[method].from_training(training)


@dataclass(frozen=True)
class Side:
    """One sequence of a pair: its ids and `counted[t] = 1` where ids[t] is a counted label (counted[0] is 0)."""

    ids: list[int]
    counted: list[int]

    @property
    def num_counted(self) -> int:
        return sum(self.counted)


@dataclass(frozen=True)
class Pair:
    chosen: Side
    rejected: Side


@dataclass(frozen=True)
class PreferencePairs:
    pairs: list[Pair]  # the kept pairs, in record order
    num_records: int
    num_truncated: int  # among all records (a dropped pair that was also cut counts in both)
    num_dropped: int


@dataclass(frozen=True)
class DpoReferenceRun:
    losses: list[float]
    grad_norms: list[float]  # before clipping
    lrs: list[float]
    metrics: list[dict[str, float]]  # per step, TRL's names (METRIC_NAMES; ORPO: ORPO_METRIC_NAMES)
    ref_logps: torch.Tensor | None  # DPO: [N, 2] float32, the reference's (chosen, rejected) log-prob sums of every
    # kept pair; SimPO and ORPO (no reference): None
    data: PreferencePairs
    state_dict: dict[str, torch.Tensor] | None = None  # full fine-tuning: save_pretrained's names
    adapter: dict[str, torch.Tensor] | None = None  # LoRA: get_peft_model_state_dict's names


# --- records -> (prompt, completion) token pieces ----------------------------------------------------------------

Piece = tuple[list[int], list[int], list[int]]  # (prompt ids, completion ids, completion counted flags)


def render_chat(tokenizer, messages: list[dict], *, add_generation_prompt: bool) -> str:
    """SFT's chat rendering: the tokenizer's chat template, else "<role>: <content>\\n" lines (+ "assistant: ")."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + ("assistant: " if add_generation_prompt else "")


def common_prefix_length(a: list, b: list) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def split_record(record: dict) -> tuple[object, object, object]:
    """(prompt, chosen completion, rejected completion): strings, or lists of messages (implicit prompt resolved)."""
    chosen, rejected = record["chosen"], record["rejected"]
    if isinstance(chosen, str):
        if "prompt" not in record or not isinstance(record["prompt"], str):
            raise ValueError(f"string preference record without a string prompt: {record}")
        return record["prompt"], chosen, rejected
    if "prompt" in record and record["prompt"] is not None:
        return list(record["prompt"]), list(chosen), list(rejected)
    # TRL's extract_prompt: each side keeps at least its last message
    n = min(common_prefix_length(chosen, rejected), min(len(chosen), len(rejected)) - 1)
    return list(chosen[:n]), list(chosen[n:]), list(rejected[n:])


def string_piece(tokenizer, prompt: str, completion: str) -> Piece:
    prompt_ids = tokenizer(prompt)["input_ids"]
    if tokenizer.bos_token_id is not None and prompt_ids[:2] == [tokenizer.bos_token_id] * 2:
        prompt_ids = prompt_ids[1:]  # a prompt rendered with its template already began with BOS: one only
    completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return list(prompt_ids), completion_ids, [1] * len(completion_ids)


def chat_piece(tokenizer, prompt: list[dict], completion: list[dict]) -> Piece:
    messages = prompt + completion
    full = render_chat(tokenizer, messages, add_generation_prompt=False)
    spans = []  # character spans of the completion's assistant turns
    for turn in range(len(prompt), len(messages)):
        if messages[turn]["role"] != "assistant":
            continue
        before = render_chat(tokenizer, messages[:turn], add_generation_prompt=True)
        through = render_chat(tokenizer, messages[:turn + 1], add_generation_prompt=False)
        if not (full.startswith(through) and through.startswith(before)):
            raise ValueError(f"chat renderings are not prefixes of each other at turn {turn}: {messages}")
        spans.append((len(before), len(through)))
    opens_assistant = bool(completion) and completion[0]["role"] == "assistant"
    prompt_text = render_chat(tokenizer, prompt, add_generation_prompt=opens_assistant) if prompt else ""
    if not full.startswith(prompt_text):
        raise ValueError(f"the rendered prompt is not a prefix of the rendered conversation: {messages}")
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(encoded["input_ids"]), encoded["offset_mapping"]
    # a token overlapping a reply is the reply's (byte-level BPE joins the space before it to its first word)
    counted = [int(end > start and any(start < e and end > s for s, e in spans)) for start, end in offsets]
    boundary = next((t for t, (_, end) in enumerate(offsets) if end > len(prompt_text)), len(ids))
    if not getattr(tokenizer, "chat_template", None):  # the fallback: EOS after a final assistant turn
        ids.append(tokenizer.eos_token_id)
        counted.append(int(bool(messages) and messages[-1]["role"] == "assistant"))
    assert not any(counted[:boundary]), "a counted label inside the prompt part"
    return ids[:boundary], ids[boundary:], counted[boundary:]


def record_pieces(tokenizer, record: dict) -> tuple[Piece, Piece]:
    prompt, chosen, rejected = split_record(record)
    if isinstance(chosen, str):
        return string_piece(tokenizer, prompt, chosen), string_piece(tokenizer, prompt, rejected)
    return chat_piece(tokenizer, prompt, chosen), chat_piece(tokenizer, prompt, rejected)


# --- truncation --------------------------------------------------------------------------------------------------

def kept_lengths(*, p_c: int, c_c: int, p_r: int, c_r: int, window: int, packing: bool) -> tuple[int, int, int, int]:
    """(prompt tokens kept, completion tokens kept) of chosen, then of rejected, for prompts of p_* tokens and
    completions of c_* tokens (EOS included) in rows of `window` ids:
      unpacked  kept_s = min(p_s, max(1, L - max(c_c, c_r))), completion_s cut to L - kept_s;
      packed    kept_s = min(p_s, max(1, (L - c_c - c_r) // 2)); if kept_c + c_c + kept_r + c_r > L still:
                A = L - kept_c - kept_r, short = min(c_short, A // 2), long = A - short. On equal completions
                chosen is taken as the short one (it keeps A // 2, rejected A - A // 2)."""
    length = window
    if not packing:
        k_c = min(p_c, max(1, length - max(c_c, c_r)))
        k_r = min(p_r, max(1, length - max(c_c, c_r)))
        return k_c, min(c_c, length - k_c), k_r, min(c_r, length - k_r)
    k_c = min(p_c, max(1, (length - c_c - c_r) // 2))
    k_r = min(p_r, max(1, (length - c_c - c_r) // 2))
    m_c, m_r = c_c, c_r
    if k_c + c_c + k_r + c_r > length:
        room = length - k_c - k_r
        if c_c <= c_r:
            m_c = min(c_c, room // 2)
            m_r = room - m_c
        else:
            m_r = min(c_r, room // 2)
            m_c = room - m_r
    return k_c, m_c, k_r, m_r


def assemble(piece: Piece, *, kept_prompt: int, kept_completion: int) -> Side:
    prompt, completion, flags = piece
    ids = prompt[len(prompt) - kept_prompt:] + completion[:kept_completion]
    counted = [0] * kept_prompt + flags[:kept_completion]
    if counted:
        counted[0] = 0  # the first token of a sequence is no label
    return Side(ids=ids, counted=counted)


def tokenize_pairs(records: list[dict], *, tokenizer, seq_length: int, packing: bool) -> PreferencePairs:
    """The kept pairs of `records`, tokenised and truncated by the rules of the module docstring."""
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token")
    window = seq_length + 1
    pairs, truncated, dropped = [], 0, 0
    for record in records:
        chosen, rejected = record_pieces(tokenizer, record)
        (pc, cc, _), (pr, cr, _) = chosen, rejected
        k_c, m_c, k_r, m_r = kept_lengths(p_c=len(pc), c_c=len(cc), p_r=len(pr), c_r=len(cr), window=window,
                                          packing=packing)
        truncated += (k_c, m_c, k_r, m_r) != (len(pc), len(cc), len(pr), len(cr))
        pair = Pair(chosen=assemble(chosen, kept_prompt=k_c, kept_completion=m_c),
                    rejected=assemble(rejected, kept_prompt=k_r, kept_completion=m_r))
        rows = [len(pair.chosen.ids) + len(pair.rejected.ids)] if packing else [len(pair.chosen.ids),
                                                                               len(pair.rejected.ids)]
        assert max(rows) <= window, (rows, window)
        if pair.chosen.num_counted == 0 or pair.rejected.num_counted == 0:
            dropped += 1
            continue
        pairs.append(pair)
    if not pairs:
        raise ValueError("no preference pair keeps a counted label on both sides")
    if all(pair.chosen.ids == pair.rejected.ids for pair in pairs):
        raise ValueError("preference_identical: every pair's chosen and rejected ids are the same")
    return PreferencePairs(pairs=pairs, num_records=len(records), num_truncated=truncated, num_dropped=dropped)


def pair_arrays(pairs: list[Pair], *, seq_length: int, pad: int, packing: bool) -> dict[str, torch.Tensor]:
    """The design's arrays of the pairs: token_ids [N*R, L] int64, loss_mask [N*R, L-1] f32, position_ids
    [N*R, L-1] int64, sequence [N*R, L-1] int8 (0 chosen / 1 rejected where counted, else 0); R = 1 packed (chosen
    then rejected, positions restarting at 0), else 2 (chosen row, rejected row). Padding positions follow SFT's
    rows: packed, a segment of its own from 0; unpacked, continuing the sequence's."""
    window = seq_length + 1
    rows = [[(0, p.chosen), (1, p.rejected)] for p in pairs] if packing else \
        [[(side, seq)] for p in pairs for side, seq in ((0, p.chosen), (1, p.rejected))]
    token_ids = torch.full((len(rows), window), pad, dtype=torch.int64)
    counted = torch.zeros(len(rows), window)
    positions = torch.zeros(len(rows), window, dtype=torch.int64)
    sequence = torch.zeros(len(rows), window, dtype=torch.int8)
    for r, row in enumerate(rows):
        start = 0
        for side, seq in row:
            end = start + len(seq.ids)
            token_ids[r, start:end] = torch.tensor(seq.ids)
            counted[r, start:end] = torch.tensor(seq.counted, dtype=torch.float32)
            positions[r, start:end] = torch.arange(len(seq.ids))
            sequence[r, start:end] = side * torch.tensor(seq.counted, dtype=torch.int8)
            start = end
        positions[r, start:] = torch.arange(window - start) + (0 if packing else start)
    return {"token_ids": token_ids, "loss_mask": counted[:, 1:], "position_ids": positions[:, :-1],
            "sequence": sequence[:, 1:]}


# --- loss and metrics --------------------------------------------------------------------------------------------

def pair_losses(*, pi_c: torch.Tensor, pi_r: torch.Tensor, ref_c: torch.Tensor, ref_r: torch.Tensor, beta: float,
                loss: str, label_smoothing: float = 0.0, n_c: torch.Tensor | None = None,
                n_r: torch.Tensor | None = None) -> torch.Tensor:
    """TRL's per-pair losses [n] from the log-prob sums [n] (n_*: counted tokens of each completion, for ipo)."""
    delta = (pi_c - ref_c) - (pi_r - ref_r)
    if loss == "sigmoid":
        eps = label_smoothing
        return -(1 - eps) * F.logsigmoid(beta * delta) - eps * F.logsigmoid(-beta * delta)
    if loss == "ipo":
        n_c, n_r = n_c.to(pi_c.dtype).clamp(min=1), n_r.to(pi_r.dtype).clamp(min=1)
        return ((pi_c - ref_c) / n_c - (pi_r - ref_r) / n_r - 1 / (2 * beta)) ** 2
    if loss == "hinge":
        return torch.relu(1 - beta * delta)
    raise ValueError(f"unknown DPO loss {loss!r}")


def dpo_metrics(*, pi_c: torch.Tensor, pi_r: torch.Tensor, ref_c: torch.Tensor, ref_r: torch.Tensor,
                beta: float) -> dict[str, float]:
    """TRL's logged DPO metrics, means over the pairs (rewards from the log-prob SUMS, for every loss)."""
    rc, rr = beta * (pi_c - ref_c), beta * (pi_r - ref_r)
    return {"rewards/chosen": rc.mean().item(), "rewards/rejected": rr.mean().item(),
            "rewards/accuracies": (rc > rr).float().mean().item(), "rewards/margins": (rc - rr).mean().item(),
            "logps/chosen": pi_c.mean().item(), "logps/rejected": pi_r.mean().item()}


def simpo_pair_losses(*, avg_c: torch.Tensor, avg_r: torch.Tensor, beta: float, gamma: float,
                      label_smoothing: float = 0.0) -> torch.Tensor:
    """TRL CPOTrainer's loss_type="simpo" (cpo_alpha=0) per pair [n], from the AVERAGED log-probs [n]."""
    z = beta * (avg_c - avg_r) - gamma
    eps = label_smoothing
    return -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)


def orpo_log_odds(*, avg_c: torch.Tensor, avg_r: torch.Tensor) -> torch.Tensor:
    """TRL ORPOTrainer's log odds ratio per pair [n], from the AVERAGED log-probs [n] (all < 0)."""
    return (avg_c - avg_r) - (torch.log1p(-torch.exp(avg_c)) - torch.log1p(-torch.exp(avg_r)))


def orpo_loss(*, pi_c: torch.Tensor, pi_r: torch.Tensor, n_c: torch.Tensor, n_r: torch.Tensor, beta: float,
              chosen_tokens: float | torch.Tensor | None = None, num_pairs: int | None = None) -> torch.Tensor:
    """ORPO's step loss NLL - beta mean(logsigmoid(log_odds)) of a global batch from its log-prob SUMS [n] and
    counted labels [n]: NLL = -sum(pi_c) / sum(n_c). For a micro-batch's part of a global batch, pass that global
    batch's `chosen_tokens` (sum of n_c) and `num_pairs`: the parts then sum to the global batch's loss."""
    n_c, n_r = n_c.to(pi_c.dtype), n_r.to(pi_r.dtype)
    chosen_tokens = n_c.sum() if chosen_tokens is None else chosen_tokens
    num_pairs = len(pi_c) if num_pairs is None else num_pairs
    ratio = F.logsigmoid(orpo_log_odds(avg_c=pi_c / n_c, avg_r=pi_r / n_r))
    return -pi_c.sum() / chosen_tokens - beta * ratio.sum() / num_pairs


def _averaged_metrics(*, avg_c: torch.Tensor, avg_r: torch.Tensor, beta: float) -> dict[str, float]:
    rc, rr = beta * avg_c, beta * avg_r
    return {"rewards/chosen": rc.mean().item(), "rewards/rejected": rr.mean().item(),
            "rewards/accuracies": (rc > rr).float().mean().item(), "rewards/margins": (rc - rr).mean().item(),
            "logps/chosen": avg_c.mean().item(), "logps/rejected": avg_r.mean().item()}


def simpo_metrics(*, pi_c: torch.Tensor, pi_r: torch.Tensor, n_c: torch.Tensor, n_r: torch.Tensor,
                  beta: float) -> dict[str, float]:
    """TRL CPOTrainer's logged metrics (SIMPO_METRIC_NAMES), means over the pairs, from the log-prob SUMS."""
    return _averaged_metrics(avg_c=pi_c / n_c.to(pi_c.dtype), avg_r=pi_r / n_r.to(pi_r.dtype), beta=beta)


def orpo_metrics(*, pi_c: torch.Tensor, pi_r: torch.Tensor, n_c: torch.Tensor, n_r: torch.Tensor,
                 beta: float) -> dict[str, float]:
    """TRL ORPOTrainer's logged metrics (ORPO_METRIC_NAMES), over the pairs of one global batch."""
    n_c, n_r = n_c.to(pi_c.dtype), n_r.to(pi_r.dtype)
    avg_c, avg_r = pi_c / n_c, pi_r / n_r
    log_odds = orpo_log_odds(avg_c=avg_c, avg_r=avg_r)
    return {**_averaged_metrics(avg_c=avg_c, avg_r=avg_r, beta=beta),
            "nll_loss": (-pi_c.sum() / n_c.sum()).item(), "log_odds_ratio": F.logsigmoid(log_odds).mean().item(),
            "log_odds_chosen": log_odds.mean().item()}


def sequence_logp(model, side: Side) -> torch.Tensor:
    """Sum over the counted labels of log p(ids[t] | ids[:t]), from a forward of the sequence alone."""
    ids = torch.tensor([side.ids])
    logits = model(input_ids=ids[:, :-1], position_ids=torch.arange(len(side.ids) - 1)[None]).logits.float()[0]
    token_logps = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]
    return (token_logps * torch.tensor(side.counted[1:], dtype=torch.float32)).sum()


def pair_logps(model, pairs: list[Pair]) -> torch.Tensor:
    """[n, 2] (chosen, rejected) log-prob sums."""
    return torch.stack([torch.stack([sequence_logp(model, p.chosen), sequence_logp(model, p.rejected)])
                        for p in pairs])


# --- training ----------------------------------------------------------------------------------------------------

def train_dpo_reference(spec_path: Path, *, chunk_pairs: int | None = None,
                        start_rounded_to: torch.dtype | None = None) -> DpoReferenceRun:
    """Train the spec's model with its training.method (dpo, simpo or orpo) for its train_steps in this process.
    `chunk_pairs` (default: the micro-batch size) only changes how the global batch is split into backwards;
    `start_rounded_to=torch.bfloat16` starts (policy and reference) from the checkpoint rounded to bf16, as a bf16
    run's fp32 master weights do. SimPO and ORPO build no reference model (the result's ref_logps is None)."""
    from transformers import AutoTokenizer

    settings = RunSettings.from_yaml(spec_path)
    spec = yaml.safe_load(Path(spec_path).read_text())
    method = method_settings(spec["training"])
    is_dpo = isinstance(method, DpoSettings)
    lora = spec["training"].get("lora")
    tokenizer = AutoTokenizer.from_pretrained(settings.model_dir)
    data = tokenize_pairs(read_jsonl(settings.data_path), tokenizer=tokenizer, seq_length=settings.seq_length,
                          packing=settings.packing)
    pairs = data.pairs

    model = load_hf_model(settings.model_dir)
    largest = max(max(p.chosen.ids + p.rejected.ids) for p in pairs)
    if largest >= model.get_input_embeddings().num_embeddings:
        raise ValueError(f"token id {largest} >= the model's vocabulary")
    if start_rounded_to is not None:
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(param.to(start_rounded_to).float())

    reference_model = None
    if is_dpo and method.reference not in ("base", "precomputed"):
        reference_model = load_hf_model(Path(method.reference)).eval().requires_grad_(False)
    if lora:
        if lora.get("train_embeddings"):
            raise NotImplementedError("the DPO reference does not model training.lora.train_embeddings")
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, lora["init_adapter"], is_trainable=True)
        config = model.peft_config["default"]
        assert (config.r, float(config.lora_alpha)) == (lora["rank"], float(lora["alpha"])), (config, lora)
        params = list({id(p): p for p in model.parameters() if p.requires_grad}.values())
        optimizer = torch.optim.AdamW([{"params": params, "weight_decay": settings.weight_decay}], lr=settings.lr,
                                      betas=settings.betas, eps=settings.eps)
    else:
        if is_dpo and reference_model is None:
            reference_model = copy.deepcopy(model).eval().requires_grad_(False)
        params = list(model.parameters())
        optimizer = adamw(model, settings)

    ref_logps = None
    with torch.no_grad():
        if not is_dpo:
            pass  # SimPO, ORPO: reference-free
        elif reference_model is not None:
            ref_logps = pair_logps(reference_model, pairs)
        else:  # LoRA, reference base: the same model with its adapters off
            was_training = model.training
            model.eval()
            with model.disable_adapter():
                ref_logps = pair_logps(model, pairs)
            model.train(was_training)
    del reference_model

    counts = torch.tensor([[p.chosen.num_counted, p.rejected.num_counted] for p in pairs], dtype=torch.float32)
    chunk = chunk_pairs or settings.micro_batch_size
    losses, norms, lrs, metrics = [], [], [], []
    for step in range(settings.train_steps):
        chosen = global_sample_indices(step=step, global_batch_size=settings.global_batch_size,
                                       num_examples=len(pairs), seed=settings.seed, shuffle=settings.shuffle)
        optimizer.zero_grad(set_to_none=True)
        total, policy = 0.0, []
        chosen_tokens = counts[chosen, 0].sum()  # ORPO's NLL denominator: the global batch's chosen tokens
        for start in range(0, len(chosen), chunk):
            indices = chosen[start:start + chunk]
            pi = pair_logps(model, [pairs[i] for i in indices])
            n = counts[indices]
            if is_dpo:
                ref = ref_logps[indices]
                per_pair = pair_losses(pi_c=pi[:, 0], pi_r=pi[:, 1], ref_c=ref[:, 0], ref_r=ref[:, 1],
                                       beta=method.beta, loss=method.loss, label_smoothing=method.label_smoothing,
                                       n_c=n[:, 0], n_r=n[:, 1])
                loss = per_pair.sum() / len(chosen)
            elif isinstance(method, SimpoSettings):
                per_pair = simpo_pair_losses(avg_c=pi[:, 0] / n[:, 0], avg_r=pi[:, 1] / n[:, 1], beta=method.beta,
                                             gamma=method.gamma, label_smoothing=method.label_smoothing)
                loss = per_pair.sum() / len(chosen)
            else:
                loss = orpo_loss(pi_c=pi[:, 0], pi_r=pi[:, 1], n_c=n[:, 0], n_r=n[:, 1], beta=method.beta,
                                 chosen_tokens=chosen_tokens, num_pairs=len(chosen))
            loss.backward()
            total += loss.item()
            policy.append(pi.detach())
        pi, n = torch.cat(policy), counts[chosen]
        if is_dpo:
            ref = ref_logps[chosen]
            metrics.append(dpo_metrics(pi_c=pi[:, 0], pi_r=pi[:, 1], ref_c=ref[:, 0], ref_r=ref[:, 1],
                                       beta=method.beta))
        else:
            metric_fn = simpo_metrics if isinstance(method, SimpoSettings) else orpo_metrics
            metrics.append(metric_fn(pi_c=pi[:, 0], pi_r=pi[:, 1], n_c=n[:, 0], n_r=n[:, 1], beta=method.beta))
        norm, lr = clip_and_step(optimizer, params=params, step=step, settings=settings)
        losses.append(total)
        norms.append(norm)
        lrs.append(lr)
        assert math.isfinite(total), (step, total)

    if lora:
        from peft import get_peft_model_state_dict

        adapter = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
        return DpoReferenceRun(losses=losses, grad_norms=norms, lrs=lrs, metrics=metrics, ref_logps=ref_logps,
                               data=data, adapter=adapter)
    return DpoReferenceRun(losses=losses, grad_norms=norms, lrs=lrs, metrics=metrics, ref_logps=ref_logps, data=data,
                           state_dict=saved_state(model))
