"""data.type: Alpaca and ShareGPT records train exactly as the prompt/completion and chat records a user would
write by hand from them (the Stanford Alpaca template and the role names written out here, not read from
toolkit/), and each bad record is named, with its line, by `dsmt check` / `dsmt train --dry-run` (exit 2)."""

from __future__ import annotations

import json

import pytest
import yaml
from data_helpers import SIMPLE_TEMPLATE

from toolkit.cli import main as dsmt
from toolkit.data import load_records, tokenize_examples
from toolkit.spec.schema import DataSpec

ALPACA = [{"instruction": "add", "input": "ab", "output": "c"},
          {"instruction": "say hi", "input": "", "output": "hi"},
          {"instruction": "name", "output": "x"}]
SHAREGPT = [{"conversations": [{"from": "system", "value": "be"}, {"from": "human", "value": "hi"},
                               {"from": "gpt", "value": "ok"}, {"from": "human", "value": "a"},
                               {"from": "gpt", "value": "b"}]},
            {"conversations": [{"from": "user", "value": "q"}, {"from": "assistant", "value": "r"}]}]


def alpaca_prompt(record: dict) -> str:
    """The Stanford Alpaca prompt, as its repository writes it."""
    if record.get("input"):
        return ("Below is an instruction that describes a task, paired with an input that provides further context. "
                "Write a response that appropriately completes the request.\n\n"
                f"### Instruction:\n{record['instruction']}\n\n### Input:\n{record['input']}\n\n### Response:\n")
    return ("Below is an instruction that describes a task. Write a response that appropriately completes the "
            f"request.\n\n### Instruction:\n{record['instruction']}\n\n### Response:\n")


def examples_of(rows, *, write_jsonl, cache_dir, tokenizer, name, **fields):
    data = DataSpec(path=write_jsonl(rows, name=name), packing=False, **fields)
    return tokenize_examples(records=load_records(data=data, cache_dir=cache_dir), data=data, tokenizer=tokenizer,
                             seq_length=400)


def test_alpaca_is_its_template_as_prompt_and_output_as_completion(write_jsonl, cache_dir, tokenizer):
    alpaca = examples_of(ALPACA, write_jsonl=write_jsonl, cache_dir=cache_dir, tokenizer=tokenizer, name="a.jsonl",
                         type="alpaca")
    by_hand = [{"prompt": alpaca_prompt(r), "completion": r["output"]} for r in ALPACA]
    reference = examples_of(by_hand, write_jsonl=write_jsonl, cache_dir=cache_dir, tokenizer=tokenizer,
                            name="b.jsonl", prompt_field="prompt", completion_field="completion")
    assert alpaca.token_ids.tolist() == reference.token_ids.tolist()
    assert alpaca.loss_mask.tolist() == reference.loss_mask.tolist()
    for row, record in enumerate(ALPACA):  # loss on the output and its EOS only
        output = tokenizer(record["output"], add_special_tokens=False)["input_ids"]
        assert int(alpaca.loss_mask[row].sum()) == len(output) + 1


@pytest.mark.parametrize("template", [None, SIMPLE_TEMPLATE])
def test_sharegpt_is_the_chat_with_roles_renamed(template, write_jsonl, cache_dir, tokenizer):
    tokenizer.chat_template = template
    sharegpt = examples_of(SHAREGPT, write_jsonl=write_jsonl, cache_dir=cache_dir, tokenizer=tokenizer,
                           name="s.jsonl", type="sharegpt")
    roles = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
    by_hand = [{"messages": [{"role": roles[t["from"]], "content": t["value"]} for t in r["conversations"]]}
               for r in SHAREGPT]
    reference = examples_of(by_hand, write_jsonl=write_jsonl, cache_dir=cache_dir, tokenizer=tokenizer,
                            name="m.jsonl", messages_field="messages")
    assert sharegpt.token_ids.tolist() == reference.token_ids.tolist()
    assert sharegpt.loss_mask.tolist() == reference.loss_mask.tolist()
    assert sharegpt.loss_mask.sum() > 0


def write_job(tmp_path, *, model_dir, data: dict):
    spec = {"model": {"path": str(model_dir)},
            "cluster": {"nodes": 1, "gpus_per_node": 1, "gpu": "cpu", "device": "cpu", "interconnect": "tcp"},
            "training": {"global_batch_size": 2, "micro_batch_size": 1, "seq_length": 64, "precision": "fp32",
                         "train_steps": 2, "warmup_steps": 0, "output_dir": str(tmp_path / "out")},
            "data": data}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.parametrize("command", [["check"], ["train", "--dry-run"]])
def test_bad_records_are_named_with_their_line(command, tmp_path, tiny_checkpoint, capsys):
    lines = [json.dumps(SHAREGPT[1]), "", json.dumps({"conversations": [{"from": "tool", "value": "x"}]}),
             json.dumps({"chats": []})]
    (tmp_path / "chats.jsonl").write_text("\n".join(lines) + "\n")
    job = write_job(tmp_path, model_dir=tiny_checkpoint, data={"path": str(tmp_path / "chats.jsonl"),
                                                               "type": "sharegpt"})
    assert dsmt([*command, str(job)]) == 2
    out = capsys.readouterr().out
    assert "[record_unknown_role]" in out and "record 2 (line 3 of" in out and "'tool'" in out, out
    assert "[record_missing_field]" in out and "record 3 (line 4 of" in out and "conversations" in out, out
    assert not (tmp_path / "out").exists()  # nothing trained, nothing written


def test_alpaca_record_without_output_is_named(tmp_path, tiny_checkpoint, capsys):
    (tmp_path / "alpaca.jsonl").write_text(json.dumps(ALPACA[0]) + "\n" + json.dumps({"instruction": "x"}) + "\n")
    job = write_job(tmp_path, model_dir=tiny_checkpoint, data={"path": str(tmp_path / "alpaca.jsonl"),
                                                               "type": "alpaca"})
    assert dsmt(["check", str(job)]) == 2
    out = capsys.readouterr().out
    assert "record 2 (line 2 of" in out and "'output'" in out, out
