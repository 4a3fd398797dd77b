"""The ``kvoffload`` command line (typer + rich).

Store commands open the store in-process and so need the index to be free:
while a sidecar runs, they exit with code 4 and say so.

Exit codes:
  0  success
  1  error (I/O, invalid store, invalid config)
  2  usage error
  3  no store at that location (run `kvoffload init`)
  4  the store's index is held by another process (a running sidecar)
  5  fsck found problems (without --repair)
  6  aborted at a confirmation prompt
  7  the sidecar is not reachable (stats)
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from .errors import SidecarStartError

if TYPE_CHECKING:
    from .sidecar.config import Config
    from .sidecar.store import Store

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_NO_STORE = 3
EXIT_LOCKED = 4
EXIT_FSCK_PROBLEMS = 5
EXIT_ABORTED = 6
EXIT_UNREACHABLE = 7

app = typer.Typer(
    name="kvoffload",
    help="KV-cache offload sidecar and its store.",
    epilog=__doc__.split("Exit codes:", 1)[1].replace("\n", "\n\n") if __doc__ else None,
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
)
keys_app = typer.Typer(help="Key management.", no_args_is_help=True)
app.add_typer(keys_app, name="keys")

out = Console()
err = Console(stderr=True, soft_wrap=True)


class _State:
    config_path: Path | None = None
    dev: bool = False
    root: Path | None = None
    index_dir: Path | None = None
    kek_file: Path | None = None
    verbose: bool = False


state = _State()


@app.callback()
def _main(
    config: Annotated[
        Path | None, typer.Option("--config", "-c", help="Config file (TOML).")
    ] = None,
    dev: Annotated[
        bool,
        typer.Option(
            "--dev",
            help="Use the embedded default store under ./.kvoffload with a development KEK.",
        ),
    ] = False,
    root: Annotated[Path | None, typer.Option("--root", help="Store root.")] = None,
    index_dir: Annotated[
        Path | None, typer.Option("--index-dir", help="Node-local index directory.")
    ] = None,
    kek_file: Annotated[
        Path | None, typer.Option("--kek-file", help="KEK credential file.")
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    state.config_path, state.dev, state.root = config, dev, root
    state.index_dir, state.kek_file, state.verbose = index_dir, kek_file, verbose
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def _config() -> Config:
    from .errors import ConfigError
    from .sidecar.config import load_config

    try:
        cfg = load_config(state.config_path, dev=state.dev)
    except ConfigError as exc:
        err.print(f"[red]config error:[/red] {exc}")
        raise typer.Exit(EXIT_ERROR) from exc
    if state.root is not None:
        cfg.store_root = state.root
    if state.index_dir is not None:
        cfg.index_dir = state.index_dir
    if state.kek_file is not None:
        cfg.kek_file = state.kek_file
    return cfg


def load_kek(cfg: Config) -> Any:
    from .sidecar.keyring import Kek, KeyringError

    try:
        if cfg.kek_file is None:
            err.print(
                "[red]no KEK:[/red] pass --kek-file, set KVOFFLOAD_KEK_FILE or [security] "
                "kek_file, or use --dev for the embedded development store"
            )
            raise typer.Exit(EXIT_ERROR)
        if cfg.dev:
            cfg.kek_file.parent.mkdir(parents=True, exist_ok=True)
            return Kek.generate_dev(cfg.kek_file)
        return Kek.from_file(cfg.kek_file)
    except KeyringError as exc:
        err.print(f"[red]KEK:[/red] {exc}")
        raise typer.Exit(EXIT_ERROR) from exc


@contextmanager
def open_store(cfg: Config, *, create: bool = False) -> Iterator[Store]:
    from .layouts import LayoutError
    from .sidecar.errors import StoreError, StoreLocked
    from .sidecar.store import Store

    kek = load_kek(cfg)
    try:
        store = Store(cfg.store_config(), kek, create=create)
    except StoreLocked as exc:
        err.print(f"[red]locked:[/red] {exc}")
        raise typer.Exit(EXIT_LOCKED) from exc
    except LayoutError as exc:
        missing = not (cfg.store_root / "layout.json").exists()
        err.print(f"[red]store:[/red] {exc}")
        raise typer.Exit(EXIT_NO_STORE if missing else EXIT_ERROR) from exc
    except (StoreError, OSError) as exc:
        err.print(f"[red]store:[/red] {exc}")
        raise typer.Exit(EXIT_ERROR) from exc
    try:
        yield store
    except StoreError as exc:  # index or key failures, mapped at the Store boundary
        err.print(f"[red]store:[/red] {exc}")
        raise typer.Exit(EXIT_ERROR) from exc
    finally:
        store.close()


def _emit(as_json: bool, data: Any, table: Table | None = None) -> None:
    if as_json:
        sys.stdout.write(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    elif table is not None:
        out.print(table)
    else:
        for k, v in data.items():
            out.print(f"{k}: {v}")


JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]


def _human_bytes(n: int | None) -> str:
    if n is None:
        return "unlimited"
    f = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if f < 1024 or unit == "TiB":
            return f"{f:.1f} {unit}" if unit != "B" else f"{int(f)} B"
        f /= 1024
    return f"{n} B"


@app.command()
def init(as_json: JsonOpt = False) -> None:
    """Create a store (layout.json, keys/, objects/) and its index."""
    cfg = _config()
    with open_store(cfg, create=True) as store:
        data = {
            "store_root": str(cfg.store_root),
            "index_dir": str(cfg.resolved_index_dir),
            "store_id": store.layout.store_id,
            "layout_version": store.layout.version,
        }
    _emit(as_json, data)


@app.command()
def inspect(as_json: JsonOpt = False) -> None:
    """Store id, layout version, tenants, namespaces, chunks, bytes, capacity."""
    cfg = _config()
    with open_store(cfg) as store:
        tenants = store.tenant_usage()
        data: dict[str, Any] = {
            "store_root": str(cfg.store_root),
            "store_id": store.layout.store_id,
            "layout_version": store.layout.version,
            "capacity_bytes": store.config.capacity_bytes,
            "used_bytes": store.used_bytes,
            "chunks": store.chunk_count(),
            "tenants": {
                t: {
                    "chunks": u.count,
                    "bytes": u.bytes,
                    "namespaces": {
                        ns.hex(): {"chunks": nu.count, "bytes": nu.bytes}
                        for ns, nu in store.namespace_usage(t).items()
                    },
                }
                for t, u in sorted(tenants.items())
            },
            "tenants_with_keys": store.tenants(),
        }
    table = Table(title=f"store {data['store_id']} (layout v{data['layout_version']})")
    for col in ("tenant", "namespaces", "chunks", "bytes"):
        table.add_column(col)
    for t, info in data["tenants"].items():
        table.add_row(
            t, str(len(info["namespaces"])), str(info["chunks"]), _human_bytes(info["bytes"])
        )
    table.caption = (
        f"{data['chunks']} chunks, {_human_bytes(data['used_bytes'])} of "
        f"{_human_bytes(data['capacity_bytes'])}"
    )
    _emit(as_json, data, table)


@app.command("ls")
def ls_(
    tenant: Annotated[str | None, typer.Option("--tenant", "-t")] = None,
    namespace: Annotated[
        str | None, typer.Option("--namespace", "-n", help="Hex fingerprint.")
    ] = None,
    older_than: Annotated[
        str | None, typer.Option("--older-than", help="Only chunks created before, e.g. 7d.")
    ] = None,
    newer_than: Annotated[str | None, typer.Option("--newer-than")] = None,
    limit: Annotated[int, typer.Option("--limit")] = 100,
    as_json: JsonOpt = False,
) -> None:
    """List chunks, filtered by tenant, namespace and age."""
    from .sidecar.config import parse_duration

    cfg = _config()
    ns = _parse_ns(namespace)
    now = time.time_ns()
    old_cut = now - int((parse_duration(older_than) or 0) * 1e9) if older_than else None
    new_cut = now - int((parse_duration(newer_than) or 0) * 1e9) if newer_than else None
    rows: list[dict[str, Any]] = []
    with open_store(cfg) as store:
        for rec in store.chunks(tenant=tenant, namespace=ns):
            if old_cut is not None and rec.created_ns >= old_cut:
                continue
            if new_cut is not None and rec.created_ns < new_cut:
                continue
            rows.append(
                {
                    "tenant": rec.tenant,
                    "key": rec.chunk_key.hex(),
                    "namespace": rec.namespace.hex(),
                    "bytes": rec.size,
                    "layers": rec.num_layers,
                    "sealed": rec.key_epoch > 0,
                    "age_s": round((now - rec.created_ns) / 1e9, 1),
                }
            )
            if len(rows) >= limit:
                break
    table = Table()
    for col in ("tenant", "key", "namespace", "bytes", "layers", "sealed", "age_s"):
        table.add_column(col)
    for r in rows:
        table.add_row(
            r["tenant"], r["key"][:16], r["namespace"][:12], str(r["bytes"]),
            str(r["layers"]), str(r["sealed"]), str(r["age_s"]),
        )  # fmt: skip
    _emit(as_json, rows, table)


def _parse_ns(namespace: str | None) -> bytes | None:
    if namespace is None:
        return None
    try:
        ns = bytes.fromhex(namespace)
    except ValueError:
        ns = b""
    if len(ns) != 32:
        err.print("[red]--namespace must be a 64-hex-digit fingerprint[/red]")
        raise typer.Exit(EXIT_USAGE)
    return ns


@app.command()
def purge(
    tenant: Annotated[str | None, typer.Option("--tenant", "-t")] = None,
    namespace: Annotated[str | None, typer.Option("--namespace", "-n")] = None,
    older_than: Annotated[str | None, typer.Option("--older-than")] = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Remove data. --tenant alone is a crypto-erase: its keys are destroyed first."""
    from .sidecar.config import parse_duration

    if tenant is None and namespace is None and older_than is None:
        err.print(
            "[red]say what to purge:[/red] --tenant, --namespace (with --tenant) or --older-than"
        )
        raise typer.Exit(EXIT_USAGE)
    if namespace is not None and tenant is None:
        err.print("[red]--namespace needs --tenant[/red]")
        raise typer.Exit(EXIT_USAGE)
    ns = _parse_ns(namespace)
    cfg = _config()
    what = (
        f"tenant {tenant} (crypto-erase: keys destroyed, irreversible)"
        if tenant and ns is None and older_than is None
        else f"namespace {namespace} of tenant {tenant}"
        if ns is not None
        else f"chunks older than {older_than}" + (f" of tenant {tenant}" if tenant else "")
    )
    if not yes and not typer.confirm(f"Purge {what}?", default=False, err=True):
        raise typer.Exit(EXIT_ABORTED)
    with open_store(cfg) as store:
        if older_than is not None:
            age = parse_duration(older_than) or 0.0
            n = store.purge_older_than(age, tenant)
            kind = "age"
        elif ns is not None:
            assert tenant is not None
            n = store.purge_namespace(tenant, ns)
            kind = "namespace"
        else:
            assert tenant is not None
            with err.status(f"erasing tenant {tenant}…"):
                n = store.purge_tenant(tenant, wait=True)
            kind = "tenant"
    _emit(as_json, {"purged": kind, "tenant": tenant, "namespace": namespace, "chunks": n})


@app.command()
def fsck(
    repair: Annotated[
        bool, typer.Option("--repair", help="Rebuild the index from the files.")
    ] = False,
    verify_data: Annotated[
        bool, typer.Option("--verify-data", help="Also decrypt/checksum every layer.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Compare the index with the files; --repair rebuilds the index from the files alone."""
    cfg = _config()
    with open_store(cfg) as store:
        if as_json:
            report = store.fsck(repair, verify_data=verify_data)
        else:
            with err.status("checking objects…") as status:
                report = store.fsck(
                    repair,
                    verify_data=verify_data,
                    progress=lambda n: status.update(f"checked {n} objects…"),
                )
    data = report.to_dict()
    _emit(as_json, data)
    if not report.clean and not repair:
        raise typer.Exit(EXIT_FSCK_PROBLEMS)


@keys_app.command("rotate-kek")
def rotate_kek(
    new_kek_file: Annotated[Path, typer.Option("--new-kek-file", help="The new KEK.")],
    as_json: JsonOpt = False,
) -> None:
    """Re-wrap every tenant's keys under a new KEK; then destroy the old KEK."""
    from .sidecar.keyring import Kek, KeyringError

    cfg = _config()
    try:
        new = Kek.from_file(new_kek_file)
    except KeyringError as exc:
        err.print(f"[red]new KEK:[/red] {exc}")
        raise typer.Exit(EXIT_ERROR) from exc
    with open_store(cfg) as store:
        n = store.rotate_kek(new)
    _emit(
        as_json,
        {
            "rewrapped_tenants": n,
            "new_kek_id": new.key_id,
            "next": "point the sidecar at the new KEK file, then destroy the old one",
        },
    )


@app.command()
def serve(
    fd: Annotated[
        int | None,
        typer.Option("--fd", help="Serve an inherited listening socket (socket activation)."),
    ] = None,
    metrics_port: Annotated[
        int | None, typer.Option("--metrics-port", help="Prometheus /metrics port (0 = off).")
    ] = None,
) -> None:
    """Run the sidecar: serve the store on its Unix socket until SIGTERM."""
    from .errors import PolicyError
    from .sidecar import notify
    from .sidecar.metrics import Metrics
    from .sidecar.policy import Policy, load_policy
    from .sidecar.server import Server, ServerConfig, load_or_create_secret, run

    cfg = _config()
    logging.getLogger().setLevel(logging.INFO)
    if cfg.policy_file is not None:
        try:
            policy = load_policy(cfg.policy_file)
        except PolicyError as exc:
            err.print(f"[red]policy:[/red] {exc}")
            raise typer.Exit(EXIT_ERROR) from exc
    elif cfg.dev:
        policy = Policy.default_dev()
    else:
        err.print("[red]no policy:[/red] set [security] policy or KVOFFLOAD_POLICY (or use --dev)")
        raise typer.Exit(EXIT_ERROR)
    if fd is None:
        inherited = notify.listen_fds()
        if len(inherited) > 1:
            err.print(f"[red]socket activation:[/red] expected one socket, got {len(inherited)}")
            raise typer.Exit(EXIT_USAGE)
        fd = inherited[0] if inherited else None
    if cfg.dev:
        err.print(
            "[bold yellow]DEVELOPMENT MODE[/bold yellow]: embedded store under "
            f"{cfg.store_root.parent}, a development KEK in a plain file, a policy that lets "
            "root and you use every tenant. Not for production."
        )
    with open_store(cfg, create=True) as store:
        index_dir = cfg.resolved_index_dir
        metrics = Metrics(store.stats)
        port = cfg.metrics_port if metrics_port is None else metrics_port
        if port:
            bound = metrics.start_http(cfg.metrics_host, port)
            err.print(f"metrics on http://{cfg.metrics_host}:{bound}/metrics")
        server = Server(
            store,
            policy,
            ServerConfig(
                socket_path=None if fd is not None else cfg.socket_path,
                socket_fd=fd,
                socket_group=cfg.socket_group,
                secret=load_or_create_secret(index_dir / "server-secret"),
                store_id=store.layout.store_id,
                workers=cfg.workers,
                handle_ttl_s=cfg.idle_reservation_timeout_s,
                max_inflight_bytes=cfg.max_inflight_bytes,
            ),
            metrics=metrics,
        )
        where = f"fd {fd}" if fd is not None else str(cfg.socket_path)
        err.print(f"kvoffload sidecar serving store {store.layout.store_id} on {where}")
        try:
            run(server)
        finally:
            metrics.stop_http()


@app.command()
def stats(as_json: JsonOpt = False) -> None:
    """Counters of the running sidecar, read over its socket (no side effects)."""
    from .client import fetch_stats
    from .protocol import ProtocolError
    from .transport import TransportError

    cfg = _config()
    try:
        data = fetch_stats(cfg.socket_path)
    except (TransportError, ProtocolError, OSError) as exc:
        err.print(f"[red]unreachable:[/red] no sidecar answered on {cfg.socket_path}: {exc}")
        raise typer.Exit(EXIT_UNREACHABLE) from exc
    _emit(as_json, data)


@app.command()
def doctor(as_json: JsonOpt = False) -> None:
    """What this node offers for I/O, and which backend auto would choose, and why.

    Reports the CUDA driver, libcuda, libcufile, nvidia-fs, kvikio and
    cufile-python, the file system and O_DIRECT support of the objects and
    index directories (a probe file is created and removed in each), and the
    backend chosen for auto and for the configured mode. Does not open the
    store, so it runs while a sidecar holds the index. Always exits 0.
    """
    import platform

    from .direct import decide as decide_direct
    from .gpu_probe import ProbeEnv, probe
    from .sidecar.iobackend import IOMode, mount_of, plan, probe_direct

    cfg = _config()
    objects_dir = cfg.store_root / "objects"
    index_dir = cfg.resolved_index_dir
    paths: dict[str, Any] = {}
    for name, path in (("objects", objects_dir), ("index", index_dir)):
        dp = probe_direct(path)
        m = mount_of(path)
        paths[name] = {
            "path": str(path),
            "exists": path.is_dir(),
            "fs_type": dp.fs_type,
            "mount_point": dp.mount_point,
            "mount_source": m.source if m else None,
            "o_direct": dp.supported,
            "o_direct_detail": dp.detail,
        }
    gpu = probe(ProbeEnv(probe_dir=objects_dir if objects_dir.is_dir() else None))
    auto = plan(IOMode.AUTO, objects_dir, gpu_report=gpu)
    data: dict[str, Any] = {
        "kernel": platform.release(),
        "store_root": str(cfg.store_root),
        "configured_io": str(cfg.io),
        "paths": paths,
        "gpu": gpu.to_dict(),
        "auto": {
            "backend": auto.backend,
            "summary": auto.describe(),
            "reason": auto.reason,
        },
    }
    direct_backend, direct_why = decide_direct(gpu)
    data["direct_path"] = {"backend": direct_backend, "reason": direct_why}
    if cfg.io is not IOMode.AUTO:
        conf = plan(cfg.io, objects_dir, gpu_report=gpu)
        data["configured"] = {
            "backend": conf.backend if conf.error is None else None,
            "summary": conf.describe() if conf.error is None else None,
            "reason": conf.reason,
            "error": conf.error,
        }
    if as_json:
        _emit(True, data)
        return
    yes_no = {True: "yes", False: "no", None: "unknown"}
    table = Table(title="kvoffload doctor", show_header=False)
    table.add_column("what")
    table.add_column("found")
    table.add_row("kernel", data["kernel"])
    table.add_row("libcuda.so.1", gpu.libcuda or gpu.libcuda_error or "-")
    table.add_row("CUDA driver version", gpu.cuda_driver_version or "-")
    table.add_row("NVIDIA kernel driver", gpu.nvidia_driver or "not loaded")
    table.add_row("/dev/nvidia*", ", ".join(gpu.nvidia_devices) or "none")
    table.add_row("nvidia-fs (GDS)", gpu.nvidia_fs or "not loaded")
    table.add_row(
        "libcufile",
        f"{gpu.libcufile} ({gpu.libcufile_version or 'version unknown'})"
        if gpu.libcufile
        else "not found" + (f" ({gpu.libcufile_version})" if gpu.libcufile_version else ""),
    )
    table.add_row("kvikio", gpu.kvikio or "not installed")
    table.add_row("cufile-python", gpu.cufile_python or "not installed")
    child = gpu.child
    table.add_row(
        "GPU probe subprocess",
        "not needed" if child is None else f"{child.elapsed_s:.2f} s: {child.error or 'ok'}",
    )
    for name, info in paths.items():
        table.add_row(
            f"{name} dir",
            f"{info['path']} on {info['fs_type'] or '?'} ({info['mount_point'] or '?'}); "
            f"O_DIRECT: {yes_no[info['o_direct']]} — {info['o_direct_detail']}",
        )
    table.add_row("auto chooses", auto.describe())
    table.add_row("because", auto.reason)
    if "configured" in data:
        c = data["configured"]
        table.add_row(f"configured ({cfg.io})", c["summary"] or f"UNAVAILABLE: {c['error']}")
    table.add_row("direct path (workers)", f"{direct_backend}: {direct_why}")
    out.print(table)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms"


@app.command()
def demo(
    prompt_tokens: Annotated[
        int, typer.Option("--prompt-tokens", help="Tokens of the shared prefix (a document).")
    ] = 1024,
    suffix_tokens: Annotated[
        int, typer.Option("--suffix-tokens", help="Tokens of each worker's own question.")
    ] = 32,
    layers: Annotated[int, typer.Option("--layers", help="Model layers.")] = 4,
    hidden: Annotated[int, typer.Option("--hidden", help="Model hidden size.")] = 256,
    heads: Annotated[int, typer.Option("--heads", help="Attention heads.")] = 4,
    kv_heads: Annotated[int, typer.Option("--kv-heads", help="KV heads.")] = 2,
    chunk_tokens: Annotated[int, typer.Option("--chunk-tokens", help="Tokens per chunk.")] = 256,
    seed: Annotated[int, typer.Option("--seed", help="Weight seed (= model revision).")] = 0,
    threads: Annotated[int, typer.Option("--threads", help="torch threads per worker.")] = 2,
    repeats: Annotated[
        int, typer.Option("--repeats", help="B's rounds of reuse + recompute (medians shown).")
    ] = 3,
    as_json: JsonOpt = False,
) -> None:
    """Cross-process KV reuse on CPU: worker A saves a prompt's KV, worker B reuses it.

    Uses the embedded development store under ./.kvoffload: a sidecar already
    answering there is reused, otherwise `kvoffload --dev serve` is started and
    stopped afterwards. Each worker is its own process with a random-weight
    transformers Llama (the weight seed is the model revision, fp32): A
    prefills a shared prefix plus its question and saves every full chunk; B,
    with the same contract, looks up and loads the prefix and computes only
    its own question, then recomputes everything to compare logits and time
    to first token (--repeats rounds, medians shown); C, another revision
    (seed + 1), must miss and recompute.
    Needs transformers (pip install 'kvoffload[demo]').
    """
    from . import demo as kd

    if not kd.transformers_available():
        err.print(f"[red]{kd.TRANSFORMERS_MISSING}[/red]")
        raise typer.Exit(EXIT_ERROR)
    try:
        shape = kd.ModelShape(
            num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads
        )
        cfg = kd.DemoConfig(
            shape=shape,
            prompt_tokens=prompt_tokens,
            suffix_tokens=suffix_tokens,
            chunk_tokens=chunk_tokens,
            seed=seed,
            other_seed=seed + 1,
            threads=threads,
            repeats=repeats,
        )
    except ValueError as exc:
        err.print(f"[red]usage:[/red] {exc}")
        raise typer.Exit(EXIT_USAGE) from exc
    try:
        if as_json:
            data = kd.run_demo(cfg)
        else:
            with err.status("starting…") as status:
                data = kd.run_demo(cfg, progress=lambda m: status.update(m))
    except SidecarStartError as exc:
        err.print(f"[red]sidecar:[/red] {exc}")
        raise typer.Exit(EXIT_UNREACHABLE) from exc
    except RuntimeError as exc:
        err.print(f"[red]demo failed:[/red] {exc}")
        raise typer.Exit(EXIT_ERROR) from exc
    if as_json:
        _emit(True, data)
        return
    a, b, c, sc = data["a"], data["b"], data["c"], data["sidecar"]
    yes_no = {True: "[green]yes[/green]", False: "[red]NO[/red]"}
    table = Table(title="kvoffload demo: one prefix, three worker processes", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("result")
    table.add_row(
        "sidecar",
        f"started (pid {sc['pid']}), stopped at the end"
        if sc["started"]
        else "already running, reused (left running)",
    )
    table.add_row("store", f"{sc['store']} (embedded development store)")
    table.add_row("model", f"{data['model_description']}, fp32, random weights")
    table.add_row(
        "prompts",
        f"{cfg.prompt_tokens} shared tokens + {cfg.suffix_tokens} of each worker's own; "
        f"chunks of {cfg.chunk_tokens} tokens; torch threads {cfg.threads} per worker",
    )
    table.add_row(
        "A: saved",
        f"{a['chunks_saved']} of {a['full_chunks']} chunks, {_human_bytes(a['bytes_saved'])} "
        f"({a['model_revision']}, prefill {_ms(a['prefill_s'])}, save {_ms(a['save_s'])})",
    )
    table.add_row(
        "B: reused",
        f"{b['chunks_reused']} chunks = {b['tokens_reused']} tokens, "
        f"{_human_bytes(b['bytes_loaded'])} loaded; computed {b['tokens_computed']} tokens",
    )
    table.add_row(
        "TTFT without reuse",
        f"{_ms(b['ttft_recompute_s'])} (full prefill; median of {b['repeats']})",
    )
    table.add_row(
        "TTFT with reuse",
        f"{_ms(b['ttft_reuse_s'])} (median of {b['repeats']}) = keys {_ms(b['keys_s'])} "
        f"+ lookup {_ms(b['lookup_s'])} "
        f"+ load {_ms(b['load_s'])} + cache {_ms(b['cache_s'])} "
        f"+ suffix prefill {_ms(b['suffix_prefill_s'])}",
    )
    speedup = data["speedup"]
    table.add_row("speed-up", f"{speedup:.1f}x" if speedup else "-")
    table.add_row(
        "logits match",
        f"{yes_no[b['logits_match']]}: max |reuse - recompute| = {b['logits_max_abs_diff']:.3g} "
        f"(tolerance {b['logits_tolerance']:.3g}); prefix KV max diff "
        f"{b['prefix_kv_max_abs_diff']:.3g}",
    )
    table.add_row(
        "greedy next token",
        f"{yes_no[b['greedy_match']]}: {b['next_token']} with reuse, "
        f"{b['recompute_next_token']} recomputed",
    )
    table.add_row(
        "C: other revision",
        f"{c['model_revision']}: {c['lookup_chunks']} chunks found, {c['chunks_reused']} "
        f"reused; recomputed {c['tokens_computed']} tokens in {_ms(c['ttft_reuse_s'])}",
    )
    out.print(table)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
