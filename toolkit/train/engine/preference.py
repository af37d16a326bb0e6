"""DPO as a task of the hybrid engine (toolkit/train/engine/tasks.py's interface): the model call of causal LM, and
a loss per preference PAIR computed from the log-probs of each sequence's completion.

A micro-batch of n pairs (toolkit/data/preference.py) holds 2n sequences, chosen and rejected of pair j being
sequences 2j and 2j + 1 (`sequence_index` per label), in 2n rows or, packed, both of a pair in one row. A sequence's
log-prob is the SUM of its counted labels' log-probs, taken from megatron's vocab-parallel cross entropy (each TP
rank holds vocab/tp columns; the cross entropy reduces max and sum-exp over TP itself), so no rank ever holds the
full-vocabulary logits or an fp32 copy of them; its gradient flows back through that cross entropy. With PP the
last stage computes it; under sequence parallelism the logits come out whole along the sequence.

The loss and its metrics are TRL's (`DPOTrainer`), with delta = (pi_c - ref_c) - (pi_r - ref_r):

    sigmoid  -(1 - eps) logsigmoid(beta delta) - eps logsigmoid(-beta delta)   (conservative DPO; eps 0: DPO)
    ipo      ((pi_c - ref_c) / n_c - (pi_r - ref_r) / n_r - 1 / (2 beta))^2   (n: the completion's counted labels)
    hinge    relu(1 - beta delta)

summed over the pairs here; the engine divides by the global batch's pairs (the unit `count` gives), so the step's
loss is the mean over its pairs whatever the layout. Metrics (`metric_names`), means over the same pairs:
rewards/chosen = beta (pi_c - ref_c), rewards/rejected, rewards/accuracies (chosen reward above rejected),
rewards/margins, logps/chosen = pi_c, logps/rejected.

The reference log-probs `ref_logps` [2n] join the micro-batch before the policy's forward: from a live reference
(`LiveReference`) or precomputed with the data (`PrecomputedReference`).

The policy runs in train mode (model and LoRA dropout as configured), the reference in eval mode (none); TRL turns
dropout off in both by default, so a model with dropout > 0 starts with nonzero rewards here. The tiny and the
usual Hub causal LMs have dropout 0."""

from __future__ import annotations

import dataclasses

import torch

from toolkit.errors import DsmtError
from toolkit.train.engine.tasks import CausalLM

METRIC_NAMES = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected")
REFERENCE_KEY = "ref_logps"  # [2n] float32: chosen, rejected of pair 0, then of pair 1, ...


@dataclasses.dataclass(frozen=True)
class Dpo:
    """`settings`: the method's section of the spec (toolkit/spec/preference.py: DpoSpec: beta, loss,
    label_smoothing)."""

    vocab_size: int
    settings: object
    name = "dpo"
    metric_names = METRIC_NAMES

    def sequence(self, batch: dict) -> torch.Tensor:
        return batch["tokens"]

    def count(self, batch: dict) -> int:
        return int(batch["pair_mask"].sum().item())

    def forward(self, model, batch: dict) -> torch.Tensor:
        return CausalLM(vocab_size=self.vocab_size).forward(model, batch)  # packed pairs attend only to themselves

    def loss_sum(self, output: torch.Tensor, batch: dict) -> torch.Tensor:
        return self.loss_terms(output, batch)[0]

    def loss_terms(self, output: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of the pairs' losses, with its graph; the metric sums over the pairs, detached)."""
        reference = batch.get(REFERENCE_KEY)
        if reference is None:
            raise DsmtError("a DPO micro-batch reached the loss without reference log-probs ('ref_logps'): the run "
                        "has no live reference and the batches brought none; set training.dpo.reference to base, "
                        "precomputed or a checkpoint path")
        policy, counts = sequence_logps(output, batch=batch)
        return dpo_loss_terms(policy=policy, reference=reference.to(policy.dtype), counts=counts,
                              pair_mask=batch["pair_mask"].to(policy.dtype), dpo=self.settings)

    def reference_logps(self, output: torch.Tensor, batch: dict) -> torch.Tensor:
        """The [2n] log-probs a reference forward gives (no graph)."""
        return sequence_logps(output, batch=batch)[0].detach().float()


def sequence_logps(logits: torch.Tensor, *, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob sums [2n] fp32, counted labels [2n]) of the micro-batch's sequences from its vocab-parallel logits
    [rows, s, vocab/tp] (consumed, as the SFT loss consumes them: toolkit/train/engine/loss.py)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    per_token = vocab_parallel_cross_entropy(logits, batch["labels"])  # padded vocab: -inf already (vocab_mask.py)
    mask = batch["loss_mask"].to(per_token.dtype)
    index = batch["sequence_index"].reshape(-1)
    size = 2 * batch["pair_mask"].shape[0]
    logps = torch.zeros(size, dtype=per_token.dtype, device=per_token.device).index_add(
        0, index, (-per_token * mask).reshape(-1))
    counts = torch.zeros(size, dtype=per_token.dtype, device=per_token.device).index_add(0, index, mask.reshape(-1))
    return logps, counts


def dpo_loss_terms(*, policy: torch.Tensor, reference: torch.Tensor, counts: torch.Tensor, pair_mask: torch.Tensor,
                   dpo) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss sum over the pairs, metric sums [len(METRIC_NAMES)]) from [2n] policy and reference log-probs; pairs
    with pair_mask 0 (validation padding) count nothing."""
    chosen_ratio = policy[0::2] - reference[0::2]
    rejected_ratio = policy[1::2] - reference[1::2]
    losses = pair_losses(chosen_ratio=chosen_ratio, rejected_ratio=rejected_ratio, chosen_count=counts[0::2],
                         rejected_count=counts[1::2], dpo=dpo)
    with torch.no_grad():
        chosen_reward, rejected_reward = dpo.beta * chosen_ratio, dpo.beta * rejected_ratio
        per_pair = torch.stack([chosen_reward, rejected_reward, (chosen_reward > rejected_reward).to(policy.dtype),
                                chosen_reward - rejected_reward, policy[0::2], policy[1::2]])
        metrics = (per_pair * pair_mask).sum(1)
    return (losses * pair_mask).sum(), metrics


def pair_losses(*, chosen_ratio: torch.Tensor, rejected_ratio: torch.Tensor, chosen_count: torch.Tensor,
                rejected_count: torch.Tensor, dpo) -> torch.Tensor:
    """One loss per pair from the log-ratios log pi - log ref of its two completions (module docstring)."""
    logsigmoid = torch.nn.functional.logsigmoid
    if dpo.loss == "ipo":  # TRL normalises IPO's log-ratios by the completion's length
        delta = chosen_ratio / chosen_count.clamp(min=1) - rejected_ratio / rejected_count.clamp(min=1)
        return (delta - 1 / (2 * dpo.beta)) ** 2
    delta = chosen_ratio - rejected_ratio
    if dpo.loss == "hinge":
        return torch.relu(1 - dpo.beta * delta)
    smoothing = dpo.label_smoothing
    return -(1 - smoothing) * logsigmoid(dpo.beta * delta) - smoothing * logsigmoid(-dpo.beta * delta)


@dataclasses.dataclass(frozen=True)
class Simpo(Dpo):
    """SimPO (toolkit/spec/preference.py SimpoSpec): reference-free, on each completion's average log-prob.
    Metrics as TRL's CPOTrainer logs them for simpo (rewards from the averages)."""

    name = "simpo"

    def loss_terms(self, output: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        policy, counts = sequence_logps(output, batch=batch)
        average = policy / counts.clamp(min=1)
        settings, mask = self.settings, batch["pair_mask"].to(policy.dtype)
        z = settings.beta * (average[0::2] - average[1::2]) - settings.gamma
        logsigmoid = torch.nn.functional.logsigmoid
        losses = -(1 - settings.label_smoothing) * logsigmoid(z) - settings.label_smoothing * logsigmoid(-z)
        return (losses * mask).sum(), reward_metrics(average, beta=settings.beta, pair_mask=mask)


ORPO_METRIC_NAMES = METRIC_NAMES + ("nll_loss", "log_odds_ratio", "log_odds_chosen")
NLL_SCALE_KEY = "nll_scale"  # ORPO: the global batch's pairs / its chosen completion tokens (`prepare_step`)


@dataclasses.dataclass(frozen=True)
class Orpo(Dpo):
    """ORPO (toolkit/spec/preference.py OrpoSpec): the chosen completions' NLL, per token over the global batch
    as SFT's loss is, minus beta times the mean log-sigmoid of the odds ratio of the average log-probs (TRL's
    ORPOTrainer's odds term; its NLL also counts the prompt's tokens, one mean per micro-batch: here the
    completion's, as SFT on prompt / completion records, the paper's L_SFT). The engine divides every sum by the
    global batch's pairs; `prepare_step` gives each micro-batch pairs / chosen tokens, so that the NLL's share comes
    out per chosen token."""

    name = "orpo"
    metric_names = ORPO_METRIC_NAMES

    def prepare_step(self, micro_batches: list[dict], *, global_units: torch.Tensor, reduce) -> None:
        """Collective over the data-parallel group (`reduce` sums a tensor there): every micro-batch gets the
        global batch's pairs / chosen completion tokens, a float64 tensor where the batches are (`global_units`:
        the pairs, int64 [1] there). Nothing is read back to the host: on a GPU that would wait for the device."""
        chosen = sum(_chosen_mask(batch).sum() for batch in micro_batches).to(torch.float64).reshape(1)
        scale = (global_units.to(torch.float64) / reduce(chosen).clamp(min=1.0)).reshape(())
        for batch in micro_batches:
            batch[NLL_SCALE_KEY] = scale

    def loss_terms(self, output: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        policy, counts = sequence_logps(output, batch=batch)
        mask = batch["pair_mask"].to(policy.dtype)
        # log(1 - p) is -inf at an average log-prob of 0: a padding pair's (no label) and a completion predicted
        # with certainty (per-token cross entropy 0.0 in fp32). Padding pairs take -1 before the log (a mask
        # applied after would keep their NaN), and averages are kept below -1e-6, so value and gradient stay finite.
        average = torch.where(mask.repeat_interleave(2) > 0, policy / counts.clamp(min=1), -1.0).clamp(max=-1e-6)
        chosen, rejected = average[0::2], average[1::2]
        log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
        ratio = torch.nn.functional.logsigmoid(log_odds)
        nll = -(policy[0::2] * mask).sum() * batch[NLL_SCALE_KEY].to(policy.dtype)
        loss = nll - self.settings.beta * (ratio * mask).sum()
        with torch.no_grad():
            extra = torch.stack([nll.detach(), (ratio * mask).sum(), (log_odds * mask).sum()])
        return loss, torch.cat([reward_metrics(average, beta=self.settings.beta, pair_mask=mask), extra])


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate on both sides of -ln 2 (Maechler's rule, as TRL's ORPO now computes it):
    log(-expm1(x)) near 0, log1p(-exp(x)) below; each branch's input kept on its own side, so the branch
    torch.where does not take gives no inf and no NaN gradient."""
    threshold = -0.6931471805599453
    near = torch.log(-torch.expm1(x.clamp(min=threshold)))
    far = torch.log1p(-torch.exp(x.clamp(max=threshold)))
    return torch.where(x > threshold, near, far)


def _chosen_mask(batch: dict) -> torch.Tensor:
    return (batch["loss_mask"] > 0) & (batch["sequence_index"] % 2 == 0)


def reward_metrics(logps: torch.Tensor, *, beta: float, pair_mask: torch.Tensor) -> torch.Tensor:
    """TRL's metric sums for a reference-free method: rewards beta * the policy's (average) log-probs [2n]."""
    with torch.no_grad():
        chosen, rejected = beta * logps[0::2], beta * logps[1::2]
        per_pair = torch.stack([chosen, rejected, (chosen > rejected).to(logps.dtype), chosen - rejected,
                                logps[0::2], logps[1::2]])
        return (per_pair.detach() * pair_mask).sum(1)


class PrecomputedReference:
    """Batches with the reference log-probs of their pairs looked up in `table` [N, 2] (chosen, rejected per pair
    index, from toolkit/train/job/preference_run.py `precomputed_table`): `batches_for_step` of the wrapped batches plus
    `ref_logps`; validation micro-batches through `add`."""

    def __init__(self, *, batches, table: torch.Tensor):
        self.batches, self.table = batches, table.float()

    def batches_for_step(self, step: int) -> list[dict]:
        return [self.add(batch) for batch in self.batches.batches_for_step(step)]

    def add(self, batch: dict) -> dict:
        return {**batch, REFERENCE_KEY: self.table[batch["pair_index"]].reshape(-1)}

    def __getattr__(self, name):  # the wrapped batches' layout (global_batch_size, ...)
        return getattr(self.batches, name)


class LiveReference:
    """DPO's reference computed with each micro-batch, forward only, dropout off: a frozen copy of the model at the
    policy's TP x PP (`chunks`: no optimizer state, no gradient, not partitioned by ZeRO), or, with `chunks` None,
    the policy itself with its LoRA adapters off (one model, two forwards). Collective over the model-parallel
    groups; `add_logps` puts `ref_logps` into each micro-batch dict on the last pipeline stage."""

    def __init__(self, *, chunks: list | None = None):
        self.chunks = chunks

    def add_logps(self, engine, micro_batches: list[dict]) -> None:
        from toolkit.train.lora.adapters import adapters_disabled

        found: list[torch.Tensor] = []

        def keep(output, batch: dict) -> None:
            found.append(engine.task.reference_logps(output, batch))

        if self.chunks is None:
            with adapters_disabled(engine.chunks):
                engine.forward_only(micro_batches, on_output=keep)
        else:
            engine.forward_only(micro_batches, on_output=keep, chunks=self.chunks)
        if found and len(found) != len(micro_batches):  # the last stage gets every micro-batch's output, in order
            raise DsmtError(f"the reference forward gave {len(found)} outputs for {len(micro_batches)} micro-batches "
                            "on the last pipeline stage; megatron's schedule ran another count: please report it")
        for batch, logps in zip(micro_batches, found):  # none on the other stages: their loss is not computed
            batch[REFERENCE_KEY] = logps.to(batch["tokens"].device)
