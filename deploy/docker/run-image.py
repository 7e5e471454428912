#!/usr/bin/env python3
"""Run an image's entry point from its own exported filesystem, without a container runtime.

    deploy/docker/run-image.py [--engine podman|docker] [-e NAME=VALUE]... [--tmpfs PATH]...
                               [--writable] [--stop-timeout S] [--rootfs DIR] IMAGE [ARG...]

For machines where the image builds (`podman build --isolation chroot`) but no container can run
(here the OCI runtime is refused setrlimit). It does what `docker run --network host --read-only
--tmpfs /tmp ... IMAGE ARG...` would, with util-linux and the kernel's namespaces:

1. reads the image's Entrypoint, Cmd, User, WorkingDir and Env (`ENGINE image inspect`);
2. unpacks its filesystem (`ENGINE create` + `ENGINE export`, numeric owners) into a tmpfs on a
   temporary folder (the image's size in memory while it runs; unmounted at the end), or into
   --rootfs DIR on disk (an empty or missing folder, kept afterwards);
3. in a private mount namespace: that root bind-mounted read-only (as readOnlyRootFilesystem in
   deploy/k8s/base; --writable leaves it writable), a fresh /dev (null, zero, full, random,
   urandom, tty, shm), /sys read-only, /proc of the new PID namespace, tmpfs on /tmp and on each
   --tmpfs PATH (default: the user's ~/.cache, the other emptyDir of deploy/k8s/base), and the
   host's /etc/hosts and /etc/resolv.conf;
4. runs Entrypoint + (ARGs, or else Cmd) as PID 1 of a new PID namespace (`unshare --pid --fork`)
   chrooted into that root, in WorkingDir, as User (its uid and gid, supplementary groups cleared,
   so without capabilities), with exactly the image's Env plus HOME (from the image's
   /etc/passwd) and the -e variables. The network is the host's, loopback included
   (`--network host`): a broker on 127.0.0.1 is reachable.

SIGTERM or SIGINT to this script goes to PID 1, as `docker stop` sends it; if PID 1 is still
running --stop-timeout seconds later (default 40, compose's stop_grace_period), it is killed with
SIGKILL, which ends every process of the namespace. Exits with PID 1's status (128+N for a
signal). Prints `run-image: PID 1 is host PID N` on stderr once it runs. Like a killed `docker
run` client, this script killed with SIGKILL leaves the namespace running (a parent-death signal
cannot reach PID 1: the kernel clears it when unshare switches to the image's user); stop it with
`kill -TERM N`, then `umount` and remove the folder it named. Needs root (mount,
chroot, unshare) and util-linux 2.38 or later (unshare --root, --wd, --setuid, --setgid).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

DEVICES = ("null", "zero", "full", "random", "urandom", "tty")


class RunImageError(Exception):
    """One clear message for the user; the script exits 125 with it (docker run's own failure code)."""


@dataclass(frozen=True)
class ImageConfig:
    entrypoint: list[str]
    cmd: list[str]
    user: str
    workdir: str
    env: list[str]


def _out(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RunImageError(f"{shlex.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return proc.stdout


def image_config(engine: str, image: str) -> ImageConfig:
    (meta,) = json.loads(_out([engine, "image", "inspect", image]))
    config = meta.get("Config") or {}
    return ImageConfig(entrypoint=list(config.get("Entrypoint") or []), cmd=list(config.get("Cmd") or []),
                       user=config.get("User") or "0", workdir=config.get("WorkingDir") or "/",
                       env=list(config.get("Env") or []))


def export_rootfs(engine: str, image: str, root: Path) -> None:
    container = _out([engine, "create", image]).strip().splitlines()[-1]
    try:
        exporter = subprocess.Popen([engine, "export", container], stdout=subprocess.PIPE)
        assert exporter.stdout is not None
        untar = subprocess.run(["tar", "-x", "--numeric-owner", "-C", str(root), "-f", "-"],
                               stdin=exporter.stdout, capture_output=True, text=True)
        exporter.stdout.close()
        if exporter.wait() != 0 or untar.returncode != 0:
            raise RunImageError(f"{engine} export {container} | tar -x failed: {untar.stderr.strip()[-2000:]}")
    finally:
        subprocess.run([engine, "rm", container], capture_output=True)


def _lookup(root: Path, table: str, name: str) -> list[str] | None:
    """The /etc/passwd or /etc/group line of the image for a name or a number."""
    path = root / "etc" / table
    for line in path.read_text(encoding="utf-8").splitlines() if path.exists() else []:
        fields = line.split(":")
        if len(fields) > 3 and name in (fields[0], fields[2]):
            return fields
    return None


def resolve_user(root: Path, spec: str) -> tuple[int, int, str]:
    """uid, gid and home of a Dockerfile USER (name or number, with or without :group)."""
    user, _, group = spec.partition(":")
    entry = _lookup(root, "passwd", user)
    if entry is None and not user.isdigit():
        raise RunImageError(f"user {user!r} is not in the image's /etc/passwd")
    uid = int(entry[2]) if entry else int(user)
    if group:
        gentry = _lookup(root, "group", group)
        if gentry is None and not group.isdigit():
            raise RunImageError(f"group {group!r} is not in the image's /etc/group")
        gid = int(gentry[2]) if gentry else int(group)
    else:
        gid = int(entry[3]) if entry else 0
    return uid, gid, entry[5] if entry and len(entry) > 5 else "/"


def mount_script(root: Path, *, uid: int, gid: int, tmpfs: list[str], writable: bool) -> str:
    """The host-side setup, run in the private mount namespace before the PID namespace starts."""
    r = shlex.quote(str(root))
    lines = ["set -eu", f"r={r}"]
    for path in tmpfs:
        lines.append(f'mkdir -p "$r"{shlex.quote(path)}')
    lines += ['mkdir -p "$r/tmp" "$r/dev" "$r/proc" "$r/sys"',
              'mount --bind "$r" "$r"']
    if not writable:
        lines.append('mount -o remount,bind,ro "$r"')
    lines += ['mount -t tmpfs -o nosuid,noexec,mode=0755,size=1m kwe-dev "$r/dev"']
    for dev in DEVICES:
        lines.append(f'touch "$r/dev/{dev}" && mount --bind /dev/{dev} "$r/dev/{dev}"')
    lines += ['mkdir "$r/dev/shm" "$r/dev/pts"',
              'mount -t tmpfs -o nosuid,nodev,noexec,mode=1777 kwe-shm "$r/dev/shm"',
              'ln -s /proc/self/fd "$r/dev/fd"',
              'ln -s /proc/self/fd/0 "$r/dev/stdin"; ln -s /proc/self/fd/1 "$r/dev/stdout"; ln -s /proc/self/fd/2 "$r/dev/stderr"',
              'mount --rbind /sys "$r/sys" && mount -o remount,bind,ro "$r/sys"',
              'mount -t tmpfs -o nosuid,nodev,mode=1777 kwe-tmp "$r/tmp"']
    for path in tmpfs:
        lines.append(f'mount -t tmpfs -o nosuid,nodev,mode=0755,uid={uid},gid={gid} kwe-tmpfs "$r"{shlex.quote(path)}')
    for etc in ("hosts", "resolv.conf"):
        lines.append(f'if [ -f /etc/{etc} ] && [ -f "$r/etc/{etc}" ]; then '
                     f'mount --bind /etc/{etc} "$r/etc/{etc}" && mount -o remount,bind,ro "$r/etc/{etc}"; fi')
    lines.append('exec "$@"')
    return "\n".join(lines)


def namespace_init(pid: int) -> int | None:
    """The host PID of the PID namespace's init: the child of `pid` that is PID 1 of its namespace."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return None
    for child in children:
        try:
            status = Path(f"/proc/{child}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("NSpid:") and len(line.split()) > 2 and line.split()[-1] == "1":
                return int(child)
    return None


def mounts_under(root: Path) -> list[str]:
    prefix = str(root.resolve())
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].encode().decode("unicode_escape")
        if point == prefix or point.startswith(prefix + "/"):
            found.append(point)
    return found


class StopRequest:
    """When SIGTERM or SIGINT came (installed first, so a stop during the unpacking is kept too)."""

    def __init__(self) -> None:
        self.at: float | None = None
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, _signum: int, _frame: FrameType | None) -> None:
        if self.at is None:
            self.at = time.monotonic()


def run(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        raise RunImageError("needs root (mount, chroot and unshare of the mount and PID namespaces)")
    unshare, env_bin = shutil.which("unshare"), shutil.which("env")
    if unshare is None or env_bin is None:
        raise RunImageError("needs util-linux's unshare and coreutils' env")
    stop = StopRequest()
    engine = args.engine or ("podman" if shutil.which("podman") else "docker")
    config = image_config(engine, args.image)
    command = config.entrypoint + (args.args or config.cmd)
    if not command:
        raise RunImageError(f"{args.image} has neither Entrypoint nor Cmd, and no command was given")

    keep = args.rootfs is not None
    root = Path(args.rootfs) if keep else Path(tempfile.mkdtemp(prefix="kwe-rootfs-", dir="/var/tmp"))
    root.mkdir(parents=True, exist_ok=True)
    if keep and any(root.iterdir()):
        raise RunImageError(f"--rootfs {root} is not empty")
    root.chmod(0o755)  # it becomes "/": mkdtemp's 0700 would keep the image's user out of everything
    if not keep:
        # In memory: unpacking is quicker, and removing it is one umount (deleting 20,000 freshly
        # written files took 10-40 s on a busy disk here).
        _out(["mount", "-t", "tmpfs", "-o", "mode=0755", "kwe-rootfs", str(root)])
    try:
        started = time.monotonic()
        try:
            export_rootfs(engine, args.image, root)
        except RunImageError:
            if stop.at is not None:  # the stop (to the whole process group) ended the export
                return 128 + signal.SIGTERM
            raise
        print(f"run-image: {args.image} unpacked into {root} in {time.monotonic() - started:.1f} s", file=sys.stderr)
        uid, gid, home = resolve_user(root, config.user)
        env = dict(item.partition("=")[::2] for item in config.env)
        env.setdefault("HOME", home)
        env.update(item.partition("=")[::2] for item in args.env)
        tmpfs = args.tmpfs if args.tmpfs is not None else [f"{home.rstrip('/')}/.cache"]
        setup = mount_script(root, uid=uid, gid=gid, tmpfs=tmpfs, writable=args.writable)
        inner = [env_bin, "-i", *(f"{k}={v}" for k, v in env.items()),
                 unshare, "--pid", "--fork", "--mount-proc", f"--root={root}",
                 f"--wd={config.workdir}", f"--setgid={gid}", f"--setuid={uid}", "--", *command]
        cmd = [unshare, "--mount", "--propagation", "private", "--", "bash", "-c", setup, "run-image", *inner]
        if stop.at is not None:
            return 128 + signal.SIGTERM
        print(f"run-image: {shlex.join(command)} as {uid}:{gid} in {config.workdir}", file=sys.stderr)
        return _supervise(subprocess.Popen(cmd), stop, args.stop_timeout)
    finally:
        if not keep:
            subprocess.run(["umount", str(root)], capture_output=True)
        left = mounts_under(root)
        if left:
            print(f"run-image: {root} still has mounts ({', '.join(left[:3])}); not removed", file=sys.stderr)
        elif not keep:
            shutil.rmtree(root, ignore_errors=True)


def _supervise(proc: subprocess.Popen[bytes], stop: StopRequest, stop_timeout: float) -> int:
    """Waits for the namespace, forwarding a stop to its PID 1 and killing it after the timeout."""
    init: int | None = None
    forwarded = killed = False
    while proc.poll() is None:
        if init is None:
            init = namespace_init(proc.pid)
            if init is not None:
                print(f"run-image: PID 1 is host PID {init}", file=sys.stderr, flush=True)
        if stop.at is not None and not forwarded:
            forwarded = True
            if init is None:  # still mounting: nothing of the image runs yet
                proc.kill()
            else:
                os.kill(init, signal.SIGTERM)
        if forwarded and not killed and init is not None and time.monotonic() - (stop.at or 0.0) > stop_timeout:
            killed = True
            print(f"run-image: PID 1 still running {stop_timeout:g} s after SIGTERM: SIGKILL", file=sys.stderr)
            os.kill(init, signal.SIGKILL)
        time.sleep(0.05)
    code = proc.returncode
    code = 128 - code if code < 0 else code
    print(f"run-image: PID 1 exited with status {code}", file=sys.stderr, flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=("podman", "docker"), default=None,
                        help="Where the image is (default: podman when installed, else docker).")
    parser.add_argument("-e", "--env", action="append", default=[], metavar="NAME=VALUE",
                        help="Add or override a variable of the image's environment.")
    parser.add_argument("--tmpfs", action="append", default=None, metavar="PATH",
                        help="A writable tmpfs at PATH, owned by the image's user (default: ~/.cache); /tmp always is one.")
    parser.add_argument("--writable", action="store_true", help="Leave the root filesystem writable.")
    parser.add_argument("--stop-timeout", type=float, default=40.0,
                        help="Seconds from SIGTERM to SIGKILL (default 40).")
    parser.add_argument("--rootfs", default=None, help="Unpack here (empty or missing) and keep it.")
    parser.add_argument("image")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="Replaces the image's Cmd, after its Entrypoint.")
    args = parser.parse_args(argv)
    try:
        return run(args)
    except RunImageError as exc:
        print(f"run-image: {exc}", file=sys.stderr)
        return 125


if __name__ == "__main__":
    sys.exit(main())
