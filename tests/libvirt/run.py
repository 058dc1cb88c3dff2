#!/usr/bin/env python3
"""libvirt-managed guests under pageone, through contrib/pageone-qemu-wrapper as <emulator>.

Starts a `pageone daemon` (as root, on a socket of its own), then boots two transient TCG guests
with `virsh create`: the domain XML names the wrapper as the emulator, and sets the wrapper's
settings with <qemu:env> (the pageone binary built here, the daemon's socket, a scope). Each
guest's initramfs holds the same data file; the guest prints its md5, waits, prints it again and
powers off.

Asserts: the process libvirt runs for each guest is QEMU itself (the wrapper and `pageone run`
exec'd it; its pid is libvirt's, with the shim preloaded), both guests join the daemon's scope
(as libvirt's QEMU user) and share pages, and every checksum is the expected one before and
after merging. Needs root, libvirt-daemon-system and libvirt-clients (libvirtd is started here if
none runs), qemu-system-x86, linux-image-amd64, busybox-static and cpio. Exits 0 with a message
when libvirt is not installed.
"""

import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGEONE = os.path.join(ROOT, "target", "release", "pageone")
WRAPPER = os.path.join(ROOT, "contrib", "pageone-qemu-wrapper")
CONNECT = "qemu:///system"
DATA_MIB = 32
GUEST_MIB = 2 * DATA_MIB + 160
WAIT_SECS = 60
SCOPE = "libvirt-test"


def log(msg):
    print(f"[libvirt-test] {msg}", flush=True)


INIT = """#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
echo "CHECKSUM $(md5sum /data | cut -d' ' -f1)"
sleep {wait}
echo "CHECK2 $(md5sum /data | cut -d' ' -f1)"
poweroff -f
"""


def data_bytes():
    # Page i: its number as text, repeated: distinct pages, the same in every guest.
    return b"".join((b"%08d" % i) * 512 for i in range(DATA_MIB * 256))


def build_initramfs(work, data):
    root = os.path.join(work, "root")
    for d in ("bin", "proc", "sys", "dev"):
        os.makedirs(os.path.join(root, d))
    shutil.copy("/bin/busybox", os.path.join(root, "bin", "busybox"))
    with open(os.path.join(root, "init"), "w") as f:
        f.write(INIT.format(wait=WAIT_SECS))
    os.chmod(os.path.join(root, "init"), 0o755)
    with open(os.path.join(root, "data"), "wb") as f:
        f.write(data)
    img = os.path.join(work, "initramfs.cpio")
    subprocess.run(
        f"cd {root} && (find . ! -name data; echo ./data) | cpio -o -H newc --quiet > {img}",
        shell=True,
        check=True,
    )
    shutil.rmtree(root)
    return img


DOMAIN = """<domain type='qemu' xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'>
  <name>{name}</name>
  <memory unit='MiB'>{mib}</memory>
  <vcpu>1</vcpu>
  <os>
    <type arch='x86_64' machine='pc'>hvm</type>
    <kernel>{kernel}</kernel>
    <initrd>{initrd}</initrd>
    <cmdline>console=ttyS0 quiet panic=-1 rdinit=/init rootfstype=ramfs</cmdline>
  </os>
  <features><acpi/></features>
  <on_poweroff>destroy</on_poweroff>
  <on_crash>destroy</on_crash>
  <devices>
    <emulator>{wrapper}</emulator>
    <serial type='file'>
      <source path='{console}'/>
      <target port='0'/>
    </serial>
    <memballoon model='none'/>
  </devices>
  <qemu:commandline>
    <qemu:env name='PAGEONE_BIN' value='{pageone}'/>
    <qemu:env name='PAGEONE_SOCKET' value='{socket}'/>
    <qemu:env name='PAGEONE_SCOPE' value='{scope}'/>
    <qemu:env name='PAGEONE_MERGE_PERIOD_MS' value='100'/>
  </qemu:commandline>
</domain>
"""


def virsh(*args, check=True):
    return subprocess.run(
        ["virsh", "-q", "-c", CONNECT, *args], capture_output=True, text=True, check=check
    )


def ensure_libvirtd():
    """A running libvirtd and virtlogd (systemd starts them on a host; a container has no
    systemd): those there, else started here (returned, to stop)."""
    started = []
    if not os.path.exists("/run/libvirt/virtlogd-sock"):
        log("starting virtlogd")
        started.append(subprocess.Popen(["virtlogd"], stderr=subprocess.DEVNULL))
    if virsh("version", check=False).returncode != 0:
        log("starting libvirtd")
        started.append(subprocess.Popen(
            ["libvirtd", "--timeout", "0"], stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL))
    for _ in range(100):
        if (virsh("version", check=False).returncode == 0
                and os.path.exists("/run/libvirt/virtlogd-sock")):
            return started
        time.sleep(0.1)
    for p in started:
        p.kill()
    sys.exit("libvirtd or virtlogd did not start")


def status(socket):
    out = subprocess.run(
        [PAGEONE, "--config", "/dev/null", "status", "--json", "--socket", socket],
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout) if out.returncode == 0 else None


def our_scope(st):
    for s in (st or {}).get("scopes", []):
        if s["scope"].startswith(SCOPE):
            return s
    return None


def read(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def lines_with(tag, path):
    """The values of the console's complete lines starting with `tag`: the serial console is
    slow, so a line still being written is not read."""
    text = read(path)
    done = text[: text.rfind("\n") + 1]
    return [ln.split()[1] for ln in done.splitlines()
            if ln.startswith(tag + " ") and len(ln.split()) == 2]


def wait_for(what, secs, f):
    t0 = time.time()
    while time.time() - t0 < secs:
        v = f()
        if v:
            return v
        time.sleep(0.5)
    sys.exit(f"timed out: {what}")


def check_qemu_process(name, socket):
    """The pid libvirt knows for the guest is QEMU itself, with the shim and the socket."""
    pid = int(read(f"/run/libvirt/qemu/{name}.pid").strip())
    exe = os.readlink(f"/proc/{pid}/exe")
    env = dict(
        kv.split("=", 1)
        for kv in read(f"/proc/{pid}/environ").split("\0")
        if "=" in kv
    )
    assert "qemu-system-x86_64" in exe, f"libvirt's pid {pid} runs {exe}, not QEMU"
    assert "libpageone_preload.so" in env.get("LD_PRELOAD", ""), env
    assert env.get("PAGEONE_SOCKET") == socket, env
    log(f"{name}: pid {pid} is {exe}, shim preloaded, socket {socket}")
    return pid


def main():
    if shutil.which("virsh") is None or shutil.which("libvirtd") is None:
        log("skipped: libvirt is not installed (apt-get install libvirt-daemon-system "
            "libvirt-clients)")
        return
    if os.geteuid() != 0:
        sys.exit("run as root (the system libvirt instance)")
    for need in (PAGEONE, os.path.join(ROOT, "target", "release", "libpageone_preload.so")):
        if not os.path.exists(need):
            sys.exit(f"{need} is missing: cargo build --release -p pageone -p pageone-preload")
    libvirtd = ensure_libvirtd()
    # Everything the guests' QEMU (libvirt's QEMU user) reads or writes is in a directory it
    # can reach; the daemon's socket directory is root's and 0755, the socket 0666.
    work = tempfile.mkdtemp(prefix="pageone-libvirt-")
    os.chmod(work, 0o755)
    sockdir = tempfile.mkdtemp(prefix="pageone-libvirt-sock-", dir="/run")
    os.chmod(sockdir, 0o755)
    socket = os.path.join(sockdir, "pageone.sock")
    daemon = subprocess.Popen(
        [PAGEONE, "--config", "/dev/null", "daemon", "--socket", socket],
        stderr=subprocess.DEVNULL,
    )
    names = [f"pageone-libvirt-test-{os.getpid()}-{i}" for i in range(2)]
    try:
        wait_for("the daemon listening", 10, lambda: status(socket) is not None)
        # The wrapper as installed, with the pageone built here as its default (libvirt also
        # runs the emulator to probe it, without the domain's <qemu:env>).
        wrapper = os.path.join(work, "pageone-qemu-wrapper")
        with open(WRAPPER) as f:
            text = f.read()
        assert "/usr/bin/pageone}" in text, "the wrapper's default pageone moved"
        with open(wrapper, "w") as f:
            f.write(text.replace("/usr/bin/pageone}", PAGEONE + "}"))
        os.chmod(wrapper, 0o755)
        data = data_bytes()
        want = hashlib.md5(data).hexdigest()
        initrd = build_initramfs(work, data)
        kernel = os.path.join(work, "vmlinuz")
        shutil.copy(sorted(glob.glob("/boot/vmlinuz-*"))[-1], kernel)
        consoles, pids = [], []
        for name in names:
            console = os.path.join(work, f"{name}.console")
            xml = os.path.join(work, f"{name}.xml")
            with open(xml, "w") as f:
                f.write(DOMAIN.format(
                    name=name, mib=GUEST_MIB, kernel=kernel, initrd=initrd, wrapper=wrapper,
                    console=console, pageone=PAGEONE, socket=socket, scope=SCOPE))
            r = virsh("create", xml, check=False)
            if r.returncode != 0:
                sys.exit(f"virsh create failed: {r.stderr.strip()}")
            log(f"started {name}")
            consoles.append(console)
            pids.append(check_qemu_process(name, socket))
        for c in consoles:
            wait_for(f"{c}: first checksum", 180, lambda: lines_with("CHECKSUM", c))
        data_pages = DATA_MIB * 256
        sc = wait_for(
            "both guests' data shared in the daemon's scope",
            120,
            lambda: (lambda s: s if s and len(s["clients"]) == 2
                     and s["pages_sharing"] >= data_pages // 2 else None)(
                         our_scope(status(socket))),
        )
        log(f"scope {sc['scope']}: {len(sc['clients'])} clients, pages shared "
            f"{sc['pages_shared']}, sharing {sc['pages_sharing']}, saved "
            f"{sc['saved_bytes'] / 1048576:.1f} MiB")
        for c in consoles:
            wait_for(f"{c}: second checksum", WAIT_SECS + 120, lambda: lines_with("CHECK2", c))
            for tag in ("CHECKSUM", "CHECK2"):
                got = lines_with(tag, c)
                assert got == [want], f"{c}: {tag} {got} != {want}\n{read(c)}"
        log("every checksum as written, before and after merging")
        wait_for("the guests powered off", 60,
                 lambda: all(virsh("domstate", n, check=False).returncode != 0 for n in names))
        # libvirt saw QEMU exit (it is the process it started): nothing is left of either guest.
        wait_for("the guests' processes gone", 10,
                 lambda: not any(os.path.exists(f"/proc/{p}") for p in pids))
        log("both guests powered off; their QEMU processes are gone")
        log("passed")
    finally:
        for n in names:
            virsh("destroy", n, check=False)
        daemon.kill()
        daemon.wait()
        for p in reversed(libvirtd):
            p.terminate()
            p.wait()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(sockdir, ignore_errors=True)


if __name__ == "__main__":
    main()
