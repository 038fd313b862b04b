"""A vLLM OpenAI server on 127.0.0.1 passes the weight-push checks of the in-process engine.

Pushes go by gloo broadcast (the default for servers) and as base64 bytes over
HTTP; a killed server is restarted and gets the pushed weights again; without
the run's token every route but /health is refused and changes nothing. One
server start (~20-40 s on 2 cores) for the module, one more for the restart.
The module's server meets a taken port at its first start and chooses another.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from dataclasses import replace

import psutil
import pytest
import torch

import tests.e2e.requires_vllm  # noqa: F401,E402  (skips the module, naming the extra, without vLLM; a broken install fails)

from megatron_rl.config import RolloutConfig  # noqa: E402
from megatron_rl.rollout import SamplingSpec, VLLMServer, VLLMServerEngine  # noqa: E402
from megatron_rl.rollout.engine import EngineStartError  # noqa: E402
from megatron_rl.weight_sync import WeightPushError, bucketize, push_weights  # noqa: E402
from tests.e2e.episode_routes import check_episode_routes  # noqa: E402
from tests.e2e.vllm_helpers import (  # noqa: E402
    build_models,
    hf_router_topk,
    hf_state_dict,
    max_logprob_error,
    socket_files,
    vllm_processes_below,
)

TOL = 1e-4
PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 10, 11, 12, 13, 14, 15], [1, 20]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_models(tmp_path_factory.mktemp("vllm-server-models"))


@pytest.fixture(scope="module")
def server_engine(models, tmp_path_factory):
    """The module's server. The port it chose first is taken before it binds it (by a socket here; in a CI run by
    another process's connection): the race a chosen port has, seen by test_a_chosen_port_taken_..."""
    import socket

    config = RolloutConfig(kv_cache_gib=0.25, max_model_len=128, return_routed_experts=True, server_start_timeout_s=240)
    server = VLLMServer(models["moe0"], config, log_path=tmp_path_factory.mktemp("vllm-server") / "server.log",
                        extra_args=["--max-num-seqs", "6"])
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        FIRST_START["taken"] = server.port = holder.getsockname()[1]
        server.start()
    FIRST_START["port"], FIRST_START["log"] = server.port, server.log_path.read_text()
    engine = VLLMServerEngine([server], config)
    yield engine
    engine.shutdown()


FIRST_START: dict = {}


def test_server_weight_push(server_engine, models):
    assert server_engine.weight_transport == "broadcast"
    spec = SamplingSpec(n=2, max_new_tokens=10, seed=3, temperature=0.9)
    base = server_engine.generate(PROMPTS, spec)
    assert len(base) == 6 and base.weight_version == 0
    assert max_logprob_error(models["moe0"], base, 0.9) < TOL

    stats = push_weights(server_engine, bucketize(hf_state_dict(models["moe1"]).items(), 64 << 10), version=3)
    assert stats.version == 3 and server_engine.weight_version == 3
    pushed = server_engine.generate(PROMPTS, spec)
    assert pushed.weight_version == 3
    assert max_logprob_error(models["moe1"], pushed, 0.9) < TOL

    # reloading identical weights changes nothing (MoE re-pack + prefix-cache reset over HTTP)
    push_weights(server_engine, bucketize(hf_state_dict(models["moe1"]).items(), 64 << 10), version=4)
    again = server_engine.generate(PROMPTS, spec)
    assert [s.response_token_ids.tolist() for s in again] == [s.response_token_ids.tolist() for s in pushed]
    assert max_logprob_error(models["moe1"], again, 0.9) < TOL

    # a bad push is refused whole; the server keeps serving version 4
    state = hf_state_dict(models["moe0"])
    state["model.layers.0.mlp.gate.weight"] = torch.zeros(4, 64)
    with pytest.raises(WeightPushError, match=r"model.layers.0.mlp.gate.weight.*\[4, 64\]"):
        push_weights(server_engine, bucketize(state.items(), 64 << 10), version=5)
    kept = server_engine.generate(PROMPTS, spec)
    assert kept.weight_version == 4 and server_engine.weight_version == 4
    assert max_logprob_error(models["moe1"], kept, 0.9) < TOL

    # routed experts come back from the server too
    routed = server_engine.generate(PROMPTS[:2], SamplingSpec(n=2, max_new_tokens=8, seed=5, return_routed_experts=True))
    for s in routed:
        ids, margin = hf_router_topk(models["moe1"], s.token_ids, 2)
        differ = (s.routed_experts.long().sort(dim=-1).values[:-1] != ids[:-1]).any(dim=-1)
        assert not (differ & (margin[:-1] > 1e-5)).any()
    # and over multi-turn episodes: every turn's request recorded on the server (rollout.agents.routes)
    check_episode_routes(server_engine, models["moe1"], PROMPTS, seed=5)


def test_a_cpu_server_runs_its_worker_inside_its_engine_core(server_engine):
    # vLLM's CPU platform would spawn a third interpreter for the one worker (its mp executor); the server's
    # environment keeps it in the engine core (rollout.engine_env.worker_in_engine_core)
    server = server_engine.servers[0]
    assert vllm_processes_below(server.process.pid) == ["VLLM::EngineCore"]
    log = server.log_path.read_text()
    assert "(EngineCore" in log and "(VllmWorker" not in log and "(Worker" not in log, log[-3000:]
    # and its model's threads leave one CPU to the API server, as vLLM's spawned worker would
    cpus = len(os.sched_getaffinity(0))
    assert server_engine.model_info["cpu_threads"] == int(os.environ.get("OMP_NUM_THREADS", max(1, cpus - 1)))
    # the engine core ends after its shutdown: its heap stays frozen through it (megatron_rl.heap)
    assert server_engine.model_info["heap_frozen_until_exit"] is True
    # a job's stop signals reach every process of it (Slurm's TERM at a requeue or a pre-emption, srun's USR1): the
    # server and its core outlive both (rollout.engine_env.stop_signals_blocked), so the step in progress keeps them
    processes = [psutil.Process(server.process.pid), *psutil.Process(server.process.pid).children(recursive=True)]
    for process in processes:
        process.send_signal(signal.SIGTERM)
        process.send_signal(signal.SIGUSR1)
    assert server_engine.generate(PROMPTS, SamplingSpec(n=1, max_new_tokens=2, seed=1)).metrics["restarts"] == 0
    assert all(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in processes), processes


def test_a_chosen_port_taken_before_the_server_binds_it_is_chosen_again(server_engine, models, tmp_path):
    # the race a chosen port has: free when VLLMServer picks it, taken by another process before the server,
    # seconds later, binds it (a colocated CI run lost its server so). The module's server met it at its start.
    import socket

    import httpx

    assert FIRST_START["port"] != FIRST_START["taken"]
    assert os.strerror(errno.EADDRINUSE) in FIRST_START["log"]  # the first try met the taken port
    assert httpx.get(f"{server_engine.urls[0]}/health", timeout=10).status_code == 200
    # a port given by the caller is kept: its failure is the caller's to see, at once (no vLLM started for it)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        config = RolloutConfig(kv_cache_gib=0.25, max_model_len=128, server_start_timeout_s=240)
        given = VLLMServer(models["moe0"], config, port=holder.getsockname()[1], log_path=tmp_path / "given.log")
        with pytest.raises(EngineStartError, match=r"port \d+ on 127.0.0.1, given to the vLLM server, is in use"):
            given.start()
        assert given.process is None and not (tmp_path / "given.log").exists()


def test_without_the_token_every_route_is_refused_and_changes_nothing(server_engine, models, monkeypatch):
    """Every route the server has (its OpenAPI list), asked without the token or with a wrong one: 401, except GET
    /health. Then the weights, their version, the sleep and pause states are as the trainer left them."""
    import httpx

    from megatron_rl.rollout.server_auth import ServerTokenError

    url, token = server_engine.urls[0], server_engine.token
    assert token and len(token) >= 32  # a VLLMServer gets a random one unless given one
    push_weights(server_engine, bucketize(hf_state_dict(models["moe1"]).items(), 64 << 10), version=30)
    routes = httpx.get(f"{url}/openapi.json", headers=server_engine.auth_headers, timeout=30).json()["paths"]
    assert {"/collective_rpc", "/sleep", "/wake_up", "/is_sleeping", "/reset_prefix_cache", "/pause", "/update_weights",
            "/v1/completions", "/v1/models", "/tokenize"} <= set(routes)
    routes.update({path: {"get": {}} for path in ("/openapi.json", "/docs", "/metrics")})  # not in its own list
    answers = {}
    with httpx.Client(timeout=30) as anyone:
        for path, methods in routes.items():
            for method in methods:
                for variant, headers in enumerate(({}, {"Authorization": "Bearer not-the-token-0123456789"},
                                                   {"Authorization": token})):
                    request = anyone.build_request(method.upper(), url + path.replace("{", "").replace("}", ""),
                                                   json=None if method == "get" else {}, headers=headers)
                    answers[(method.upper(), path, variant)] = anyone.send(request).status_code
        # what an attacker would send: a weight push, a new version, sleep, pause, a generation
        attacks = [("/collective_rpc", {"method": "mrl_set_version", "args": ["77"]}),
                   ("/collective_rpc", {"method": "mrl_begin_push", "args": ["78"]}),
                   ("/sleep?level=1", None), ("/pause", None), ("/reset_prefix_cache", None),
                   ("/v1/completions", {"model": server_engine.model_name, "prompt": [1, 5], "max_tokens": 2})]
        for path, body in attacks:
            answers[("POST", path, 0)] = anyone.post(url + path, json=body).status_code
        health = anyone.get(f"{url}/health")
    assert health.status_code == 200
    assert {key: code for key, code in answers.items() if code != 401} == {("GET", "/health", v): 200 for v in range(3)}
    assert len(answers) > 100

    # with the token, a bucket whose tensor is of another kind of dtype than the checkpoint's is refused by the
    # worker before it touches the model (the right name and shape, integers for a float weight)
    from megatron_rl.weight_sync.buckets import bucket_to_b64

    norm = hf_state_dict(models["moe0"])["model.norm.weight"]
    server_engine._rpc(url, "mrl_begin_push", "31")
    with pytest.raises(Exception, match="'model.norm.weight' comes as int32 but the engine's checkpoint holds F32"):
        server_engine._rpc(url, "mrl_stage_weights", bucket_to_b64([("model.norm.weight", norm.to(torch.int32))]))
    authed = httpx.Client(timeout=30, headers=server_engine.auth_headers)
    assert authed.get(f"{url}/is_sleeping").json()["is_sleeping"] is False
    assert authed.get(f"{url}/is_paused").json()["is_paused"] is False
    assert int(server_engine._rpc(url, "mrl_weight_version")) == 30
    authed.close()
    rollouts = server_engine.generate(PROMPTS, SamplingSpec(n=2, max_new_tokens=10, seed=3, temperature=0.9))
    assert rollouts.weight_version == 30 and max_logprob_error(models["moe1"], rollouts, 0.9) < TOL

    # a client without the token stops at once, in one line naming where the token goes
    for name in ("MEGATRON_RL_SERVER_TOKEN", "MEGATRON_RL_SERVER_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ServerTokenError) as refused:
        VLLMServerEngine([url], server_engine.config)
    assert "HTTP 401" in str(refused.value) and "rollout.server_token_file" in str(refused.value)
    assert "\n" not in str(refused.value)
    assert token not in server_engine.servers[0].log_path.read_text()  # never logged


def test_request_limits_hold_before_the_token_check_and_the_scheme_is_read_in_any_case(server_engine):
    """A request head over 64 KiB gets 431 with the server having read at most the limit and its socket buffers of it
    (uvicorn's default parser read and held a 128 MiB header); a declared body over rollout.server_max_body_mb gets
    413 before it is sent; `bearer` in lower case opens the routes (RFC 7235); the server serves on."""
    import socket

    import httpx

    from megatron_rl.rollout.server_limits import HEAD_LIMIT_BYTES
    from tests.unit.test_server_auth import send_head, status_of

    url, token = server_engine.urls[0], server_engine.token
    port = int(url.rsplit(":", 1)[1])
    sent, answer = send_head(port, HEAD_LIMIT_BYTES + (16 << 10), end=False)
    assert status_of(answer) == 431, answer[:200]
    sent, answer = send_head(port, 64 << 20)
    assert sent < 32 << 20, sent
    with httpx.Client(timeout=30) as client:
        assert client.get(f"{url}/v1/models", headers={"Authorization": f"bearer {token}"}).status_code == 200
        assert client.get(f"{url}/v1/models", headers={"Authorization": f"bearer {token}x"}).status_code == 401
        limit = int(server_engine.config.server_max_body_mb * 1_000_000)
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:  # the length only: no body is sent
            sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {token}\r\n"
                         f"Content-Length: {limit + 1}\r\n\r\n".encode())
            assert status_of(sock.recv(1 << 16)) == 413
        assert client.get(f"{url}/health").status_code == 200


def test_in_flight_prompts_follow_the_server_and_a_long_request_is_slow_not_dead(server_engine, models):
    # the server runs at most 6 sequences at once; a prompt of n=2 samples takes 2 of them
    assert server_engine.max_num_seqs == [6] and server_engine.prompts_in_flight(2) == [3]
    spec = SamplingSpec(n=2, max_new_tokens=60, seed=8, temperature=0.9, ignore_eos=True)
    start = time.perf_counter()
    reference = server_engine.generate(PROMPTS, spec)
    elapsed = time.perf_counter() - start
    # the same batch with a control-call timeout far below the time its requests take: still no restart
    client = VLLMServerEngine([server_engine.urls[0]], server_engine.config, token=server_engine.token)
    config = client.config = replace(server_engine.config, request_timeout_s=max(0.05, elapsed / 6))
    try:
        rollouts = client.generate(PROMPTS, spec)
    finally:
        client.shutdown()
    assert rollouts.metrics["restarts"] == 0 and rollouts.metrics["generate_s"] > config.request_timeout_s
    assert [s.response_token_ids.tolist() for s in rollouts] == [s.response_token_ids.tolist() for s in reference]


def test_server_weight_push_as_bytes_over_http(server_engine, models):
    config = RolloutConfig(kv_cache_gib=0.25, max_model_len=128, weight_transport="rpc")
    engine = VLLMServerEngine([server_engine.urls[0]], config, token=server_engine.token)  # a second client
    try:
        assert engine.weight_transport == "rpc"
        push_weights(engine, bucketize(hf_state_dict(models["moe0"]).items(), 64 << 10), version=7)
        spec = SamplingSpec(n=2, max_new_tokens=10, seed=4, temperature=0.9)
        pushed = engine.generate(PROMPTS, spec)
        assert pushed.weight_version == 7
        assert max_logprob_error(models["moe0"], pushed, 0.9) < TOL
    finally:
        engine.shutdown()  # closes the client only: the server belongs to the fixture


def test_killed_server_is_restarted_with_the_pushed_weights(server_engine, models):
    push_weights(server_engine, bucketize(hf_state_dict(models["moe1"]).items(), 64 << 10), version=8)
    spec = SamplingSpec(n=2, max_new_tokens=10, seed=6, temperature=0.9)
    before = server_engine.generate(PROMPTS, spec)
    assert max_logprob_error(models["moe1"], before, 0.9) < TOL

    server = server_engine.servers[0]
    # the API server dies alone (a crash, the OOM killer): its engine core would live on, holding the engine's
    # memory (on a GPU the restart would not fit beside it); the restart ends it. Its sockets' directory goes too.
    core, sockets = psutil.Process(server.process.pid).children(recursive=True), server._sockets.path
    assert socket_files(sockets), sockets  # vLLM's sockets are in the server's own directory
    # and its engine core's temp files: the file store its worker's group meets in (vLLM leaves it; the directory goes)
    assert [n for n in os.listdir(sockets) if n.startswith("vllm_dist_")], os.listdir(sockets)
    os.kill(server.process.pid, signal.SIGKILL)
    server.process.wait()
    # no host copy of the last push is kept: the restarted server gets a fresh export from the trainer
    server_engine.reexport_fn = lambda: bucketize(hf_state_dict(models["moe1"]).items(), 64 << 10)
    try:
        after = server_engine.generate(PROMPTS, spec)
    finally:
        server_engine.reexport_fn = None
    assert after.metrics["restarts"] == 1 and after.weight_version == 8
    assert core and not [p for p in core if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], core
    assert not os.path.exists(sockets) and socket_files(server._sockets.path)
    # the restarted server loaded moe0 from its directory; these are moe1's logprobs, so the push was repeated
    assert max_logprob_error(models["moe1"], after, 0.9) < TOL
    assert [s.response_token_ids.tolist() for s in after] == [s.response_token_ids.tolist() for s in before]


def test_supervised_server_comes_back_for_an_engine_that_did_not_start_it(server_engine, models):
    # A colocated engine hosted by another trainer rank: rank 0's engine knows only its URL, the
    # host's ServerSupervisor restarts it. The engine waits for it, pushes again, and carries on.
    from megatron_rl.rollout.colocated import ServerSupervisor

    server = server_engine.servers[0]
    supervisor = ServerSupervisor(server, poll_s=0.2)
    client = VLLMServerEngine(
        [server.url], server_engine.config, reexport_fn=lambda: bucketize(hf_state_dict(models["moe1"]).items(), 64 << 10),
        token=server_engine.token,
    )
    try:
        assert client.servers == [None]  # an external server to this engine: it waits, never restarts
        push_weights(client, bucketize(hf_state_dict(models["moe1"]).items(), 64 << 10), version=9)
        spec = SamplingSpec(n=2, max_new_tokens=10, seed=7, temperature=0.9)
        before = client.generate(PROMPTS, spec)
        os.killpg(server.process.pid, signal.SIGKILL)
        after = client.generate(PROMPTS, spec)
        # the supervisor counts its restart when its own /health poll (every 0.5 s) answers: the client, polling
        # too, may have pushed and sampled before that
        deadline = time.monotonic() + 10.0
        while supervisor.restarts == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert supervisor.restarts == 1 and after.metrics["restarts"] == 1 and after.weight_version == 9
        assert max_logprob_error(models["moe1"], after, 0.9) < TOL  # moe1 again, not the directory's moe0
        assert [s.response_token_ids.tolist() for s in after] == [s.response_token_ids.tolist() for s in before]
    finally:
        client.shutdown()
        supervisor.stop(stop_server=False)  # the module's engine stops it


def test_servers_sleep_through_vllms_endpoints_and_vllm_cpu_says_it_frees_nothing(server_engine, models, caplog):
    # rollout.sleep_level on a server engine: POST /sleep?level=N while the trainer trains, /wake_up?tags=weights
    # for the push, /wake_up?tags=kv_cache after it. vllm-cpu has no sleep mode (the server refuses
    # --enable-sleep-mode there): the endpoints run and pause / resume its scheduler, and the engine says once
    # that the memory stays.
    import logging

    import httpx

    url = server_engine.urls[0]

    def sleeping() -> bool:
        return httpx.get(f"{url}/is_sleeping", timeout=10, headers=server_engine.auth_headers).json()["is_sleeping"]

    client = VLLMServerEngine([url], replace(server_engine.config, sleep_level=2), token=server_engine.token)
    try:
        assert (client.sleep_mode, client.platform_sleep_mode) == ([False], [False])
        with caplog.at_level(logging.WARNING, logger="megatron_rl.rollout.engine_base"):
            assert client.sleep() is False and sleeping()
            client.wake_up(["weights"])
            assert sleeping()  # the KV cache still sleeps: vLLM resumes scheduling only once all is awake
            push_weights(client, bucketize(hf_state_dict(models["moe1"]).items(), 64 << 10), version=12)
            client.wake_up()
            assert not sleeping()
            assert client.sleep() is False and sleeping()  # the next step: not said again
        said = [r for r in caplog.records if "stays while the trainer trains" in r.getMessage()]
        assert len(said) == 1 and "no sleep mode" in said[0].getMessage(), [r.getMessage() for r in caplog.records]
        # generating wakes a sleeping server first (its paused scheduler would hold the requests forever)
        rollouts = client.generate(PROMPTS, SamplingSpec(n=2, max_new_tokens=10, seed=11, temperature=0.9))
        assert not sleeping() and rollouts.weight_version == 12
        assert max_logprob_error(models["moe1"], rollouts, 0.9) < TOL
    finally:
        client.shutdown()


def test_episode_turns_stay_on_their_server_and_new_episodes_go_to_the_least_loaded(server_engine, models):
    """Episodes on servers (rollout.agents.turns): every turn of an episode goes to the server of its first turn
    (its prefix cache holds the conversation), first turns to the server with the fewest live episodes; the turns'
    tokens and engine logprobs are the model's (an HF forward of each whole episode). One real server behind two
    entries of the client's list: the client schedules two servers."""
    from types import SimpleNamespace

    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.rollout.agents import Environment, EpisodeRunner, StepResult
    from megatron_rl.rollout.rewards import exact_match
    from tests.e2e.vllm_helpers import hf_model

    url = server_engine.urls[0]
    pusher = VLLMServerEngine([url], replace(server_engine.config, weight_transport="rpc"), token=server_engine.token)
    try:
        push_weights(pusher, bucketize(hf_state_dict(models["moe0"]).items(), 1 << 20), version=20)
    finally:
        pusher.shutdown()
    calls: list[tuple[int, list[int]]] = []

    class Recording(VLLMServerEngine):
        def complete_turn(self, server, request, spec, client=None):
            calls.append((server, list(request.token_ids)))
            return super().complete_turn(server, request, spec, client)

    class ThreeTurns(Environment):
        def step(self, turn):
            return StepResult(observation=[7, 8, 9], done=turn.index >= 2)

    engine = Recording([url, url], server_engine.config, token=server_engine.token)
    tokenizer = load_tokenizer(models["moe0"])
    # distinct prompts: an episode's requests are known by its prompt
    prompts = [SimpleNamespace(token_ids=[1, 40 + i, 50 + i, 60], text="", answer="", index=i, row={}) for i in range(6)]
    try:
        runner = EpisodeRunner(ThreeTurns, tokenizer, exact_match, RolloutConfig(agent="single_turn", agent_max_turns=3))
        batch = runner.run(engine, prompts, SamplingSpec(n=1, max_new_tokens=8, seed=6, stop_token_ids=list(range(4, 40))))
    finally:
        engine.shutdown()  # the client only: the server is the fixture's
    servers_of = [{s for s, ids in calls if ids[: sample.prompt_length] == sample.prompt_token_ids.tolist()}
                  for sample in batch.rollouts.samples]
    assert all(len(s) == 1 for s in servers_of), servers_of  # every turn of an episode on one server
    assert sorted(next(iter(s)) for s in servers_of) == [0, 0, 0, 1, 1, 1]  # six episodes started together: three each
    assert len(calls) == sum(e.turns for e in batch.episodes) > 6  # one request per turn, several turns each
    model = hf_model(str(models["moe0"]))
    for sample in batch.rollouts.samples:
        with torch.no_grad():
            logits = model(sample.token_ids[None]).logits[0].float()
        reference = torch.log_softmax(logits, dim=-1)[sample.prompt_length - 1 : -1].gather(1, sample.response_token_ids[:, None])[:, 0]
        mask = sample.response_loss_mask
        assert float((reference[mask] - sample.rollout_logprobs[mask]).abs().max()) < TOL
