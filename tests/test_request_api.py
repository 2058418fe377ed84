"""A request's API (issue 37, item 1): `experts_per_token` the one name of k (the old
`top_k=` keyword deprecated, `--top-k` refused), sampling as one SamplingParams, log-probs
on the token event, and the Backend protocol both backends satisfy."""
import asyncio
import inspect
import warnings

import numpy as np
import pytest

from colibri_core.engine import Engine
from colibri_core.errors import RequestError
from colibri_core.runtime.sampler import SamplingParams


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    with Engine.from_model_dir(tiny_model_dir, threads=1) as e:
        yield e


def test_old_top_k_keyword_is_deprecated_and_still_sets_k(tiny):
    with pytest.warns(DeprecationWarning, match="experts_per_token"):
        g = tiny.generate([1, 2], max_new_tokens=1, top_k=1)
    assert (g.k, g.k_source) == (1, "argument")
    with pytest.warns(DeprecationWarning):
        old = tiny.next_token_logits([1, 2, 3], top_k=1)
    np.testing.assert_array_equal(old, tiny.next_token_logits([1, 2, 3], experts_per_token=1))
    with pytest.warns(DeprecationWarning), pytest.raises(RequestError, match="disagree"):
        tiny.generate([1, 2], experts_per_token=2, top_k=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")           # the new name warns about nothing
        assert tiny.generate([1, 2], max_new_tokens=1, experts_per_token=2).k == 2


def test_cli_top_k_is_refused_naming_the_new_option(capsys):
    from colibri_core.cli import main
    with pytest.raises(SystemExit) as e:
        main(["run", "--top-k", "2"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--top-k was renamed" in err and "--experts-per-token" in err
    assert err.count("\n") == 1


def test_sampling_params_are_the_keywords_as_one_object(tiny):
    a = tiny.generate([5, 6], max_new_tokens=8, temperature=0.7, seed=3, top_p=0.9).run()
    b = tiny.generate([5, 6], max_new_tokens=8,
                      sampling=SamplingParams(temperature=0.7, seed=3, top_p=0.9)).run()
    assert a.token_ids == b.token_ids
    with pytest.raises(RequestError, match="temperature"):
        tiny.generate([5, 6], sampling=SamplingParams(), temperature=0.5)
    with pytest.raises(RequestError, match="top_k"):
        tiny.generate([5, 6], sampling=SamplingParams(top_k=-1))


def test_logprobs_ride_on_the_token_event(tiny):
    g = tiny.generate([5, 6, 7], max_new_tokens=4,
                      sampling=SamplingParams(temperature=0, logprobs=2))
    evs = list(g)
    assert evs and all(ev.logprob is not None for ev in evs)
    first = tiny.next_token_logits([5, 6, 7], experts_per_token=g.k).astype(np.float64)
    lp = first - first.max() - np.log(np.exp(first - first.max()).sum())
    text, value, top = evs[0].logprob
    assert value == pytest.approx(lp[evs[0].token_id], abs=1e-5)
    assert len(top) == 2 and top[0][1] >= top[1][1]
    assert all(ev.logprob is None for ev in tiny.generate([5, 6, 7], max_new_tokens=2))


def test_async_iteration_gets_the_same_tokens_and_text(tiny):
    want = tiny.generate([9, 8, 7], max_new_tokens=6, temperature=0, stop=["zz"]).run()

    async def main():
        g = tiny.generate([9, 8, 7], max_new_tokens=6, temperature=0, stop=["zz"])
        ids = [ev.token_id async for ev in g]
        return ids, g.text, g.stop_reason
    assert asyncio.run(main()) == (want.token_ids, want.text, want.stop_reason)


def test_both_backends_satisfy_the_backend_protocol():
    from colibri_core.fleet.ingress import RayBackend
    from colibri_core.server.backend import Backend, LocalBackend
    members = [n for n in vars(Backend) if not n.startswith("_")] + \
        list(Backend.__annotations__)
    assert {"generate", "score", "stamp", "snapshot", "running"} <= set(members)
    for cls in (LocalBackend, RayBackend):
        for name, want in vars(Backend).items():
            if name.startswith("_"):
                continue
            got = getattr(cls, name, None)
            assert got is not None, f"{cls.__name__} lacks {name}"
            if isinstance(want, property):
                assert isinstance(got, property), f"{cls.__name__}.{name}: not a property"
            elif callable(want):
                assert list(inspect.signature(got).parameters) == \
                    list(inspect.signature(want).parameters), f"{cls.__name__}.{name}"
                assert inspect.iscoroutinefunction(got) == inspect.iscoroutinefunction(want), \
                    f"{cls.__name__}.{name}: async or not as the protocol says"
        assert isinstance(cls.kind, str)


def test_serve_experts_per_token_is_the_servers_default_k(tmp_path):
    from colibri_core.cli import build_parser
    from colibri_core.server.serve import resolve
    args = build_parser().parse_args(["serve", "--experts-per-token", "1", "--threads", "1",
                                      "--experts-dir", str(tmp_path)])
    _, cfg, _ = resolve(args)
    assert [(r.k, r.min_tokens, r.max_tokens) for r in cfg.length_policy] == [(1, None, None)]
    with Engine(*resolve(args)[:2]) as e:
        assert (e.generate([1, 2], max_new_tokens=1).k, e.generate([1, 2], max_new_tokens=1,
                experts_per_token=2).k) == (1, 2)


def test_both_calls_satisfy_the_call_handle_protocol():
    from colibri_core.fleet.ingress import RemoteCall
    from colibri_core.server.backend import CallHandle
    from colibri_core.server.calls import Call
    for cls in (Call, RemoteCall):
        for name in ("cancel", "__aiter__", "__anext__"):
            got, want = getattr(cls, name), getattr(CallHandle, name)
            assert list(inspect.signature(got).parameters) == \
                list(inspect.signature(want).parameters), f"{cls.__name__}.{name}"
            assert inspect.iscoroutinefunction(got) == inspect.iscoroutinefunction(want)
        assert "self.result" in inspect.getsource(cls.__init__), cls.__name__
