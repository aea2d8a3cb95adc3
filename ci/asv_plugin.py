"""ASV plugin of the Loki suite (``asv.conf.json``: ``"plugins": [".ci.asv_plugin"]``, imported by ASV from the
configuration's folder before every command).

- ``asv run``: the suite runs in ASV's *existing* environment, where ASV saves results only when told which
  commit they belong to (``--set-commit-hash``); without it ASV measures everything and silently saves nothing,
  while still rewriting the benchmark list and the machine file under ``results_dir`` (the committed
  ``.asv/results``).  Such a run now says so, before and after, and writes those two files to a scratch folder
  (``<env_dir>/unsaved-results``, git-ignored): a run that saves nothing changes nothing in the repository.
- ``asv publish``: the pages link every point to its commit and the header to the project.  With
  ``project_url`` / ``show_commit_url`` left empty in ``asv.conf.json`` they are filled from the repository's
  address: ``$LOKI_ASV_REPO_URL``, else ``$GITHUB_SERVER_URL/$GITHUB_REPOSITORY`` (the GPU job), else git's
  remote ``origin``; without any the pages have no links and the command says so.
"""

from __future__ import annotations

import os
import re
import subprocess

__all__ = ["UNSAVED", "repository_url", "setup", "wrap_publish", "wrap_run"]

UNSAVED = "unsaved-results"

_MESSAGE = ("asv run saves NO results here: this suite runs in ASV's existing environment, where ASV saves results "
            "only with --set-commit-hash=<commit> (e.g. --set-commit-hash=$(git rev-parse HEAD)); the benchmark "
            "list and machine file of this run go to {scratch}, not {results} (docs/benchmarks.md)")


def wrap_run(run_cls, log) -> None:
    """Wrap ``run_cls.run`` (asv's ``Run.run`` classmethod) once: a run in an existing environment without
    ``set_commit_hash`` warns and writes under the scratch folder instead of ``results_dir``."""
    if getattr(run_cls.run, "_loki_wrapped", False):
        return
    original = run_cls.run.__func__

    def run(cls, conf, *args, **kwargs):
        if kwargs.get("set_commit_hash") is None and getattr(conf, "environment_type", None) == "existing":
            scratch = os.path.join(conf.env_dir, UNSAVED)
            msg = _MESSAGE.format(scratch=scratch, results=conf.results_dir)
            log.warning(msg)
            conf.results_dir = scratch
            try:
                return original(cls, conf, *args, **kwargs)
            finally:
                log.warning(msg)
        return original(cls, conf, *args, **kwargs)

    run._loki_wrapped = True
    run_cls.run = classmethod(run)


def _web_url(remote: str) -> str | None:
    """``https://host/owner/name`` of a git remote (``git@host:owner/name.git``, ``https://host/owner/name.git``,
    ``ssh://git@host/owner/name``), or None for a local path."""
    remote = remote.strip()
    m = re.match(r"^(?:ssh://)?[\w.-]+@([\w.-]+)[:/](.+?)(?:\.git)?/?$", remote)
    if m:
        return f"https://{m.group(1)}/{m.group(2)}"
    m = re.match(r"^(https?)://(?:[^@/]+@)?([^/]+)/(.+?)(?:\.git)?/?$", remote)
    if m:
        return f"{m.group(1)}://{m.group(2)}/{m.group(3)}"
    return None


def repository_url(repo_dir: str = ".", environ=None) -> str | None:
    """The repository's web address (see the module docstring), or None."""
    env = os.environ if environ is None else environ
    if env.get("LOKI_ASV_REPO_URL"):
        return env["LOKI_ASV_REPO_URL"].rstrip("/")
    if env.get("GITHUB_SERVER_URL") and env.get("GITHUB_REPOSITORY"):
        return f"{env['GITHUB_SERVER_URL'].rstrip('/')}/{env['GITHUB_REPOSITORY']}"
    try:
        proc = subprocess.run(["git", "-C", repo_dir, "remote", "get-url", "origin"], capture_output=True,
                              text=True, check=False)
    except OSError:
        return None
    return _web_url(proc.stdout) if proc.returncode == 0 and proc.stdout.strip() else None


def wrap_publish(publish_cls, log, environ=None) -> None:
    """Wrap ``publish_cls.run`` once: empty ``project_url`` / ``show_commit_url`` are filled from
    :func:`repository_url`; when there is none, the command says the pages have no links."""
    if getattr(publish_cls.run, "_loki_wrapped", False):
        return
    original = publish_cls.run.__func__

    def run(cls, conf, *args, **kwargs):
        if not conf.project_url or not conf.show_commit_url or conf.show_commit_url == "#":
            url = repository_url(getattr(conf, "repo", "."), environ)
            if url:
                conf.project_url = conf.project_url if conf.project_url not in ("", "#") else url
                conf.show_commit_url = f"{url}/commit/"
            else:
                log.warning("asv publish: no repository address (set LOKI_ASV_REPO_URL or a git remote 'origin'): "
                            "the pages link to no commit")
        return original(cls, conf, *args, **kwargs)

    run._loki_wrapped = True
    publish_cls.run = classmethod(run)


def setup() -> None:
    """Called by ASV's plugin manager on import."""
    from asv.commands.publish import Publish
    from asv.commands.run import Run
    from asv.console import log

    wrap_run(Run, log)
    wrap_publish(Publish, log)
