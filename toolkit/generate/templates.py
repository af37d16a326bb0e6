"""The shell templates of the generated launch files: the shipped ones in launch/ and a site's own copies.

`dsmt generate --templates DIR` reads DIR/<name> in place of launch/<name> for each of TEMPLATE_NAMES it holds
(a site copy may add account lines, `module load`, container wrappers); the others stay the shipped ones. Python
computes every value (quoted shell words, flags such as `slurm`) and the templates hold the shell structure.
Every problem (an unknown file name, a Jinja syntax error, an undefined variable) is a DsmtError naming the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta

import toolkit
from toolkit.errors import DsmtError

SHIPPED_DIR = Path(toolkit.__file__).resolve().parents[1] / "launch"
# Template file name -> the run-directory file it renders.
TEMPLATE_NAMES = {
    "launch_deepspeed.sh": "launch_deepspeed.sh",
    "launch_torchrun.sh": "launch_torchrun.sh",
    "job.sbatch": "job.sbatch",
    "deepspeed_env": ".deepspeed_env",
}


@dataclass(frozen=True)
class LaunchTemplates:
    """The four compiled templates, each from the site dir when it holds that name, else from launch/."""

    environment: jinja2.Environment
    site_dir: Path | None
    paths: dict[str, Path]  # template name -> the file it was read from
    site_names: tuple[str, ...]  # the templates read from site_dir

    def render(self, *, name: str, context: dict[str, Any]) -> str:
        """The rendered `name`; an undefined variable is a DsmtError naming the file, the variable and the rest."""
        template = self.environment.get_template(name)
        try:
            return template.render(context)
        except jinja2.UndefinedError as err:
            raise DsmtError(self._undefined_message(name=name, context=context, error=err)) from None

    def describe(self) -> str:
        """Where the templates came from, for the command's output: 'site/ for job.sbatch; shipped for the rest'."""
        if self.site_dir is None:
            return "shipped"
        if not self.site_names:
            return f"shipped ({self.site_dir}/ holds none of {', '.join(TEMPLATE_NAMES)})"
        rest = "" if len(self.site_names) == len(TEMPLATE_NAMES) else "; shipped for the rest"
        return f"{self.site_dir}/ for {', '.join(self.site_names)}{rest}"

    def _undefined_message(self, *, name: str, context: dict[str, Any], error: jinja2.UndefinedError) -> str:
        path = self.paths[name]
        used = jinja2.meta.find_undeclared_variables(self.environment.parse(path.read_text()))
        missing = sorted(used - context.keys() - self.environment.globals.keys())
        line = _template_line(error=error, path=path)
        where = f"{path}:{line}" if line else str(path)
        what = f"undefined variable {', '.join(missing)}" if missing else str(error.message)
        return (f"{where}: {what}; the variables {name} receives: {', '.join(sorted(context))} "
                f"(the comment at the top of {SHIPPED_DIR / name} describes them)")


def load_templates(*, site_dir: Path | None) -> LaunchTemplates:
    """Compile the four templates: `site_dir`'s copies where it has them (None: all shipped)."""
    if not SHIPPED_DIR.is_dir():
        raise DsmtError(f"the shipped launch templates are missing ({SHIPPED_DIR} is not a directory): "
                        "install dsmt from a checkout of its repository (pip install -e .)")
    if site_dir is not None:
        _check_site_dir(site_dir=site_dir)
    search_path = [SHIPPED_DIR] if site_dir is None else [site_dir, SHIPPED_DIR]  # the first holding a name wins
    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(search_path), undefined=jinja2.StrictUndefined, autoescape=False,
        keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True)
    paths = {}
    for name in TEMPLATE_NAMES:
        try:
            paths[name] = Path(environment.get_template(name).filename)  # compiled: syntax errors surface now
        except jinja2.TemplateSyntaxError as err:
            raise DsmtError(f"{err.filename}:{err.lineno}: template syntax error: {err.message}") from None
    site_names = tuple(name for name in TEMPLATE_NAMES if site_dir is not None and (site_dir / name).is_file())
    return LaunchTemplates(environment=environment, site_dir=site_dir, paths=paths, site_names=site_names)


def _check_site_dir(*, site_dir: Path) -> None:
    if not site_dir.exists():
        raise DsmtError(f"--templates {site_dir}: no such directory; copy the templates you change from {SHIPPED_DIR}")
    if not site_dir.is_dir():
        raise DsmtError(f"--templates {site_dir} is not a directory; pass the directory holding the template copies")
    unknown = sorted(path.name for path in site_dir.iterdir() if path.name not in TEMPLATE_NAMES)
    if unknown:
        raise DsmtError(f"--templates {site_dir}: unknown template file(s) {', '.join(unknown)}; the templates are "
                        f"{', '.join(TEMPLATE_NAMES)} (rename or remove the others)")
    not_files = sorted(path.name for path in site_dir.iterdir() if not path.is_file())
    if not_files:
        raise DsmtError(f"--templates {site_dir}: {', '.join(not_files)} must be a file")


def _template_line(*, error: BaseException, path: Path) -> int | None:
    """The template line an error was raised on: Jinja rewrites the traceback to point into the template file."""
    line, frame = None, error.__traceback__
    while frame is not None:
        if frame.tb_frame.f_code.co_filename == str(path):
            line = frame.tb_lineno
        frame = frame.tb_next
    return line
