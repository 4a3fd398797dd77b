"""What this node offers for I/O (doctor); does not open the store."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from .app import JsonOpt, app, config, emit, out


@app.command()
def doctor(as_json: JsonOpt = False) -> None:
    """What this node offers for I/O, and which backend auto would choose, and why.

    Reports the CUDA driver, libcuda, libcufile, nvidia-fs, kvikio and
    cufile-python, the file system and O_DIRECT support of the objects and
    index directories (a probe file is created and removed in each), and the
    backend chosen for auto and for the configured mode. Does not open the
    store, so it runs while a sidecar holds the index. On a JuiceFS root it reads
    the mount's own .config for the volume's trash days (warning unless 0). Exits 0
    whatever the node offers; a configuration that does not load is one line, exit 1.
    """
    import platform

    from ..client.direct import decide as decide_direct
    from ..gpu_probe import ProbeEnv, probe
    from ..store.iobackend import IOMode, mount_of, plan, probe_direct

    cfg = config()
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
            "mount_fs_type": m.fs_type if m else None,
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
    data["sharing"] = _sharing(cfg.shared, paths)
    if cfg.io is not IOMode.AUTO:
        conf = plan(cfg.io, objects_dir, gpu_report=gpu)
        data["configured"] = {
            "backend": conf.backend if conf.error is None else None,
            "summary": conf.describe() if conf.error is None else None,
            "reason": conf.reason,
            "error": conf.error,
        }
    if as_json:
        emit(True, data)
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
    sh = data["sharing"]
    table.add_row("store root", f"{sh['family']}: {sh['advice']}")
    for warning in sh["warnings"]:
        table.add_row("warning", warning)
    out.print(table)


def _sharing(configured_shared: bool, paths: dict[str, Any]) -> dict[str, Any]:
    """Whether the store root looks shared, what that implies, and what is amiss."""
    from ..store.fstypes import classify

    root = classify(paths["objects"]["fs_type"], paths["objects"].get("mount_fs_type"))
    index = classify(paths["index"]["fs_type"], paths["index"].get("mount_fs_type"))
    warnings = []
    if index.network is not False and index.family != "unknown":
        warnings.append(
            f"the index is on {index.family}: LMDB must live on node-local disk "
            "(set [store] index_dir)"
        )
    if root.network and not configured_shared:
        warnings.append(
            f"the store root is on {root.family} but [store] shared is off: if other "
            "nodes use this root, set shared = true on every node"
        )
    if root.network is False and configured_shared:
        warnings.append(
            "[store] shared is on, but the root is on a local filesystem: only this "
            "node can reach it"
        )
    data: dict[str, Any] = {
        "fs_type": root.fs_type,
        "family": root.family,
        "looks_shared": root.network,
        "configured_shared": configured_shared,
        "advice": root.advice,
        "warnings": warnings,
    }
    if root.family == "JuiceFS" and paths["objects"].get("mount_point"):
        data["juicefs"] = _juicefs(paths["objects"]["mount_point"], warnings)
    return data


def _juicefs(mount_point: str, warnings: list[str]) -> dict[str, Any]:
    """The JuiceFS volume's trash setting (docs/shared-root.md, "JuiceFS")."""
    from pathlib import Path

    from ..store.fstypes import juicefs_settings

    jfs = juicefs_settings(Path(mount_point))
    days = jfs.get("trash_days")
    if days:
        warnings.append(
            f"JuiceFS keeps every removed file in its trash for {days} day(s): evicted "
            "objects, replaced lease files and purged tenants' key files stay on the "
            "volume (and count against it); set `juicefs config META --trash-days 0` and "
            "run `juicefs gc META --delete` periodically"
        )
    elif days is None:
        warnings.append(
            f"the JuiceFS trash setting could not be checked ({jfs['error']}): it must be "
            "0 (`juicefs config META --trash-days 0`)"
        )
    return jfs
