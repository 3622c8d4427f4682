"""Running `llgraph serve`'s app (runtime/serve/app.py): one process under uvicorn, or a Ray Serve deployment of
replicas (`--ray`). Either way SIGTERM or SIGINT stops it cleanly: uvicorn drains the scheduler; the Ray driver
shuts Serve and its local Ray down."""

from __future__ import annotations

import math
import signal
import sys
import threading

from llgraph.errors import RequestError
from llgraph.runtime.serve.access import warning
from llgraph.runtime.serve.app import ServeOptions, create_app, load_runners
from llgraph.runtime.serve.plan import memory


def _check_port(host: str, port: int) -> None:
    """One line when host:port cannot be listened on (in use, or not this machine's address)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise RequestError(f"--host {host}: {e.strerror or e}; give an address of this machine") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
        try:
            probe.bind(address)
        except OSError as e:
            raise RequestError(f"cannot listen on {host}:{port} ({e.strerror or e}); pick another --port, or stop "
                               "what holds it") from None


def serve(options: ServeOptions, *, host: str = "127.0.0.1", port: int = 8000, grace: float = 10.0) -> None:
    """One process: uvicorn on host:port. SIGTERM/SIGINT: stop admitting (503), give running requests `grace`
    seconds, cancel the rest, return (exit 0)."""
    import uvicorn

    _check_port(host, port)  # before the model loads: a busy port is one line, not a load then uvicorn's exit 3
    if warning(host, options.api_key):
        print(warning(host, options.api_key), file=sys.stderr, flush=True)
    print(f"llgraph serve: loading {options.model} ({options.backend})", flush=True)
    runner, draft = load_runners(options)  # a bad model or flag is one line, before anything listens
    if runner.backend.max_batch is not None and options.slots > runner.backend.max_batch:
        raise RequestError(f"--slots {options.slots} exceeds the engine's max batch ({runner.backend.max_batch}); "
                           "lower --slots or rebuild with `llgraph build --max-batch`")
    app = create_app(options, (runner, draft))

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)  # the model loaded (lifespan), then the socket bound
            if self.started:
                _announce(options, _url(host, port), memory(runner.backend, options.slots),
                          runner.sampling_defaults.describe())

        def handle_exit(self, sig, frame):
            scheduler = getattr(app.state, "scheduler", None)
            if scheduler is None or scheduler.draining:  # not started yet, or a second signal: stop now
                if scheduler is not None:
                    scheduler.drain(0)
                return super().handle_exit(sig, frame)
            # still listening while it drains, so anything new gets a 503 rather than a refused connection; the
            # running requests finish or, at the grace deadline, end with an error; then uvicorn stops
            scheduler.drain(grace)
            exit_after_drain = super().handle_exit
            threading.Thread(target=lambda: (scheduler.stop(grace), exit_after_drain(sig, frame)), daemon=True,
                             name="llgraph-drain").start()

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=math.ceil(grace))
    # uvicorn handles SIGTERM/SIGINT while it runs, then re-raises the signal to the handler it found: a drained,
    # finished server has nothing left to do, so that handler does nothing and serve() returns (exit 0)
    previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        Server(config).run()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    print("llgraph serve: stopped", flush=True)


def serve_on_ray(options: ServeOptions, replicas: int, *, host: str = "127.0.0.1", port: int = 8000,
                 address: str | None = None) -> None:
    """The same app as a Ray Serve deployment of `replicas` replicas (each loads its own runner), on a local Ray
    (default) or the cluster at `address` ("auto" joins the one `ray start` made here). Blocks until interrupted."""
    try:
        import ray
        from ray import serve as ray_serve
    except ImportError as e:
        from llgraph.errors import MissingExtra

        raise MissingExtra("llgraph serve --ray", "'ray[serve]'", "ray", e) from None
    if warning(host, options.api_key):
        print(warning(host, options.api_key), file=sys.stderr, flush=True)
    ray.init(address=address, include_dashboard=False, log_to_driver=False)
    ray_serve.start(http_options={"host": host, "port": port})
    def build_app():  # a builder (a function, not an app): Ray Serve calls it on each replica
        return create_app(options)

    ingress = ray_serve.ingress(build_app)()
    deployment = ray_serve.deployment(ingress, name="llgraph", num_replicas=replicas,
                                      ray_actor_options={"num_cpus": 0})
    ray_serve.run(deployment.bind(), name="llgraph", route_prefix="/", blocking=False)
    try:
        wait_for_interrupt(ready=lambda: _announce(options, _url(host, port),
                                                   f", {replicas} Ray Serve replicas"))
    finally:
        ray_serve.shutdown()
        ray.shutdown()


def wait_for_interrupt(ready=lambda: None, tick: float = 0.5) -> None:
    """Call `ready()` (the announcement that the server is up), then block until SIGINT or SIGTERM. Both are
    handled here from before `ready` on, whatever the process inherited: a shell's background job starts with
    SIGINT ignored, and SIGTERM's default would skip Ray's shutdown. The wait wakes every `tick` seconds, because
    Python runs signal handlers on the main thread only, whichever thread the signal reached."""
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        ready()
        while not stop.wait(tick):
            pass
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _url(host: str, port: int) -> str:
    """The address to announce: an IPv6 host in brackets (`http://[::]:8000`), as URLs write it."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _announce(options: ServeOptions, url: str, extra: str = "", sampling: str = "") -> None:
    drafting = f", {options.draft} drafting" if options.draft else ""
    print(f"llgraph serve: '{options.served_name}' from {options.model} on {options.backend}{drafting}, "
          f"{options.slots} slots"
          f"{extra}, listening at {url} (a chat page at /; /v1/chat/completions, /v1/completions, /v1/embeddings, "
          "/v1/responses, /v1/messages, /v1/models, /tokenize, /detokenize, /health, /metrics)"
          f"{'; any model name is answered (--any-model)' if options.any_model else ''}",
          flush=True)
    if sampling:  # (Ray Serve's replicas each load their own; GET /props says it there)
        print(f"llgraph serve: a request that sets no sampling field samples with {sampling}", flush=True)
