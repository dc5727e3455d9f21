"""``segment-eval eigen=...``: the cuts' eigensolver chosen for a whole run (for the paired
comparison Krylov against dense, issue 56), in the cache's fingerprint, refused where it
would change nothing."""

from __future__ import annotations

import pytest

from segment import backends
from segment.eval.cache import fingerprint
from segment.eval.runner import EXIT_BAD_INPUT, EXIT_OK, run_eval
from test_eval import TINY, cfg_for, make_folder


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("eigen") / "set", n=3, seed=5)


def _solvers(monkeypatch) -> list:
    """Record the backend every cut's eigenvector is asked of (then solve as asked)."""
    seen: list = []
    real = backends.second_eigenvectors

    def spy(sym, backend=None, size=None):
        seen.append(backend)
        return real(sym, backend=backend, size=size)

    monkeypatch.setattr(backends, "second_eigenvectors", spy)
    return seen


@pytest.mark.parametrize("eigen", ["torch", "scipy", None])
def test_the_run_cuts_with_the_chosen_solver(tmp_path, data, monkeypatch, eigen):
    seen = _solvers(monkeypatch)
    extra = [] if eigen is None else [f"eigen={eigen}"]
    cfg = cfg_for(*TINY, "method=cuts", f"dataset.root={data}", f"output={tmp_path}",
                  "panels=0", "bootstrap=0", *extra)
    assert run_eval(cfg) == EXIT_OK
    assert seen and set(seen) == {eigen}  # None: the device's default inside the method


def test_the_fingerprint_keeps_runs_with_a_chosen_solver_apart(data):
    base = cfg_for(*TINY, "method=cuts", f"dataset.root={data}")
    dense = cfg_for(*TINY, "method=cuts", f"dataset.root={data}", "eigen=torch")
    krylov = cfg_for(*TINY, "method=cuts", f"dataset.root={data}", "eigen=krylov")
    keys = {fingerprint(c) for c in (base, dense, krylov)}
    assert len(keys) == 3
    assert fingerprint(base) == fingerprint(cfg_for(*TINY, "method=cuts", f"dataset.root={data}",
                                                    "eigen=null"))


def test_a_solver_that_does_not_exist_or_changes_nothing_is_refused(tmp_path, data, capsys):
    """One line on stderr, exit 2, before any image is read."""
    for method, eigen, says in (
            ("cuts", "lanczos", "eigen must be one of krylov, torch, scipy (or null: the device's),"
                                " got 'lanczos'"),
            ("cls_attention", "torch", "eigen=torch has no effect: no method of this run cuts")):
        cfg = cfg_for(*TINY, f"method={method}", f"dataset.root={data}",
                      f"output={tmp_path / method}", f"eigen={eigen}")
        assert run_eval(cfg) == EXIT_BAD_INPUT
        err = capsys.readouterr().err.strip()
        assert says in err and len(err.splitlines()) == 1
        assert not (tmp_path / method / "results.json").exists()
