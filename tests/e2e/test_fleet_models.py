"""Several models behind one router: pools from each instance's ``/v1/models``."""

from __future__ import annotations

import httpx
from kvtest import debug_route, engines, start_engine, start_router, wait_until

FAST = ("--profile", "full", "--time-scale", "50")


def test_a_requests_model_picks_the_instances_that_serve_it(tmp_path):
    with (
        engines(tmp_path, 1, *FAST, "--model", "alpha") as (a,),
        engines(tmp_path, 1, *FAST, "--model", "beta") as (b,),
    ):
        # remote: each request is tokenized by an instance of its pool (its model's tokenizer)
        router = start_router(tmp_path, [a, b], "--tokenizer", "remote")
        try:
            url = f"{router.url}/v1/completions"
            prompt = "a prompt both models could cache, but only alpha's instance does. " * 4
            for _ in range(3):
                r = httpx.post(url, json={"model": "alpha", "prompt": prompt}, timeout=30)
                assert r.status_code == 200, r.text
                assert r.headers["x-kvroute-instance"] == a.url
            wait_until(
                lambda: debug_route(router, {"model": "alpha", "prompt": prompt})["candidates"][0][
                    "gpu_tokens"
                ] > 0,
                what="alpha's instance to report its blocks",
            )  # fmt: skip
            # beta's pool is beta's instance alone: alpha's cached prefix is not a candidate.
            view = debug_route(router, {"model": "beta", "prompt": prompt})
            assert view["model"] == {"requested": "beta", "pool": [b.url], "lora": None}
            assert [c["instance"] for c in view["candidates"]] == [b.url]
            r = httpx.post(url, json={"model": "beta", "prompt": prompt}, timeout=30)
            assert r.status_code == 200 and r.headers["x-kvroute-instance"] == b.url
            assert r.json()["model"] == "beta"
            # No model: any instance (vLLM serves its default).
            assert len(debug_route(router, {"prompt": prompt})["model"]["pool"]) == 2
            # An unknown model: vLLM's 404, from the router, for completions and chat.
            for path, body in (
                ("/v1/completions", {"model": "gamma", "prompt": "x"}),
                ("/v1/chat/completions", {"model": "gamma", "messages": [{"role": "user"}]}),
            ):
                r = httpx.post(f"{router.url}{path}", json=body, timeout=10)
                assert r.status_code == 404
                assert r.json()["error"] == {
                    "message": "The model `gamma` does not exist.",
                    "type": "NotFoundError",
                    "param": "model",
                    "code": 404,
                }
            listed = httpx.get(f"{router.url}/v1/models").json()
            assert sorted(m["id"] for m in listed["data"]) == ["alpha", "beta"]
        finally:
            router.stop()


def test_pools_follow_an_instance_restarted_with_another_model_and_declarations_win(tmp_path):
    a = start_engine(tmp_path, *FAST, "--model", "alpha")
    declared = start_engine(tmp_path, *FAST, "--model", "alpha")
    try:
        router = start_router(tmp_path, [a], "--instance", f"{declared.url}=,model=alpha-v2")
        try:
            assert debug_route(router, {"model": "alpha", "prompt": "p"})["model"]["pool"] == [
                a.url
            ]
            assert debug_route(router, {"model": "alpha-v2", "prompt": "p"})["model"]["pool"] == [
                declared.url
            ]
            port, replay_port = a.port, a.replay_port  # same ports: same event endpoints
            a.stop()
            a = start_engine(
                tmp_path, *FAST, "--model", "delta",
                port=port, replay_port=replay_port,
            )  # fmt: skip
            wait_until(
                lambda: httpx.post(
                    f"{router.url}/v1/completions", json={"model": "delta", "prompt": "p"}
                ).status_code == 200,
                what="the router to learn the restarted instance's model",
            )  # fmt: skip
            r = httpx.post(f"{router.url}/v1/completions", json={"model": "alpha", "prompt": "p"})
            assert r.status_code == 404
            admin = sorted(m["id"] for m in httpx.get(f"{router.url}/v1/models").json()["data"])
            assert admin == ["alpha-v2", "delta"]
        finally:
            router.stop()
    finally:
        a.stop()
        declared.stop()
