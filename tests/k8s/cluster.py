"""A one-node Kubernetes cluster of host processes, with KEDA, for `make k8s-test`.

etcd, kube-apiserver, kube-controller-manager, kube-scheduler, a containerd of its own
(Debian's; not Docker's) and a kubelet, built from Go modules by scripts/k8s_env.sh; KEDA's
operator and metrics adapter run as host processes too, their external-metrics API served
to the aggregator through an ExternalName Service. What makes each flag necessary on this
kind of machine (cgroup v1, no systemd, no CAP_SYS_RESOURCE, no DNS, no kube-proxy, loopback
only) is in docs/kubernetes.md, "The test cluster".

No image is pulled: images are imported into containerd from `docker save`, and pods use
``imagePullPolicy: Never``. Pods that talk to Kafka run on the host network and reach the
broker on 127.0.0.1. ``stop()`` undoes everything ``start()`` did, in the order the
daemons need (pods, kubelet, control plane, leftover tasks, containerd, mounts, bridge),
and is safe to call after a partial start.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

TOKEN = "rlbus-k8s-test-token"
CNI_BRIDGE = "rlbuscni0"
CNI_NETWORK = "rlbusnet"
PAUSE_IMAGE = "rlbus-local/pause:1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(what: str, check: Callable[[], Any], timeout: float, every: float = 0.5) -> Any:
    """Poll ``check`` until it returns something truthy; its value, or TimeoutError."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except Exception as exc:  # a daemon not up yet answers with errors
            last_error = exc
        time.sleep(every)
    raise TimeoutError(f"{what}: not within {timeout:.0f} s (last error: {last_error!r})")


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


class Cluster:
    """``Cluster(bin_dir, containerd_root).start()``; ``kubectl(...)``; ``stop()``."""

    def __init__(self, bin_dir: Path, containerd_root: Path, logs_to: Path | None = None) -> None:
        self.bin = bin_dir
        self.logs_to = logs_to
        self.containerd_root = containerd_root
        self.work = Path(tempfile.mkdtemp(prefix="rlbus-k8s-"))
        self.logs = self.work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.kubeconfig = self.work / "kubeconfig"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._log_files: list[IO[bytes]] = []
        self.timings: dict[str, float] = {}
        self.ports = {name: free_port() for name in (
            "etcd", "etcd_peer", "apiserver", "kcm", "scheduler", "kubelet", "kubelet_healthz",
            "keda_metrics", "keda_health", "keda_grpc", "adapter", "adapter_metrics")}
        self.containerd_sock = self.work / "containerd.sock"

    # -- processes

    def _spawn(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> None:
        log = (self.logs / f"{name}.log").open("ab")
        self._log_files.append(log)
        self.procs[name] = subprocess.Popen(
            list(argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})}, start_new_session=True)

    def _kill(self, name: str, timeout: float = 20) -> None:
        proc = self.procs.pop(name, None)
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)

    def tail(self, name: str, lines: int = 30) -> str:
        path = self.logs / f"{name}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def check_alive(self) -> None:
        dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
        if dead:
            raise RuntimeError(f"daemons exited: {dead}\n" + "\n".join(
                f"--- {n}\n{self.tail(n)}" for n in dead))

    # -- kubectl

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 120) -> str:
        kubectl = self.bin / "kubectl"
        proc = subprocess.run(
            [str(kubectl) if kubectl.exists() else "kubectl", f"--kubeconfig={self.kubeconfig}",
             *args], input=input,
            capture_output=True, text=True, timeout=timeout, check=False)
        if check and proc.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} failed: {proc.stderr}")
        return proc.stdout if check else proc.stdout + proc.stderr

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json"))

    def ctr(self, *args: str, check: bool = True) -> str:
        argv = ["ctr", "-a", str(self.containerd_sock), "-n", "k8s.io", *args]
        proc = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=1200)
        if check and proc.returncode != 0:
            raise RuntimeError(f"ctr {' '.join(args)} failed: {proc.stderr}")
        return proc.stdout

    # -- start

    def start(self) -> Cluster:
        for phase in (self._certs, self._control_plane, self._containerd, self._kubelet):
            t0 = time.monotonic()
            phase()
            self.timings[phase.__name__.strip("_")] = round(time.monotonic() - t0, 1)
        return self

    def _certs(self) -> None:
        w = self.work
        openssl("genrsa", "-out", str(w / "sa.key"), "2048")
        openssl("rsa", "-in", str(w / "sa.key"), "-pubout", "-out", str(w / "sa.pub"))
        (w / "tokens.csv").write_text(f"{TOKEN},admin,admin-uid,system:masters\n")
        # the aggregator's front proxy: a CA and its client certificate
        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                "-subj", "/CN=front-proxy-ca", "-keyout", str(w / "fp-ca.key"),
                "-out", str(w / "fp-ca.crt"))
        self._leaf("fp-client", "front-proxy-client", "fp-ca", "clientAuth", san=None)
        # KEDA: operator <-> adapter gRPC (mTLS) and the adapter's HTTPS, one CA and one leaf
        keda = w / "keda-certs"
        keda.mkdir()
        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                "-subj", "/CN=keda-ca", "-keyout", str(keda / "ca.key"),
                "-out", str(keda / "ca.crt"))
        self._leaf("keda-certs/tls", "localhost", "keda-certs/ca", "serverAuth,clientAuth",
                   san="DNS:localhost,IP:127.0.0.1")

    def _leaf(self, out: str, cn: str, ca: str, eku: str, san: str | None) -> None:
        w = self.work
        ext = w / f"{out.replace('/', '_')}.ext"
        ext.write_text(f"extendedKeyUsage={eku}\n" + (f"subjectAltName={san}\n" if san else ""))
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={cn}",
                "-keyout", str(w / f"{out}.key"), "-out", str(w / f"{out}.csr"))
        openssl("x509", "-req", "-in", str(w / f"{out}.csr"), "-CA", str(w / f"{ca}.crt"),
                "-CAkey", str(w / f"{ca}.key"), "-CAcreateserial", "-days", "2",
                "-extfile", str(ext), "-out", str(w / f"{out}.crt"))

    def _control_plane(self) -> None:
        w, p, b = self.work, self.ports, self.bin
        self._spawn("etcd", [
            str(b / "etcd"), "--data-dir", str(w / "etcd"),
            "--listen-client-urls", f"http://127.0.0.1:{p['etcd']}",
            "--advertise-client-urls", f"http://127.0.0.1:{p['etcd']}",
            "--listen-peer-urls", f"http://127.0.0.1:{p['etcd_peer']}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{p['etcd_peer']}",
            "--initial-cluster", f"default=http://127.0.0.1:{p['etcd_peer']}",
            "--unsafe-no-fsync"])
        self._spawn("kube-apiserver", [
            str(b / "kube-apiserver"), f"--etcd-servers=http://127.0.0.1:{p['etcd']}",
            f"--secure-port={p['apiserver']}", "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1", f"--cert-dir={w / 'serving'}",
            f"--token-auth-file={w / 'tokens.csv'}", "--authorization-mode=RBAC",
            f"--service-account-key-file={w / 'sa.pub'}",
            f"--service-account-signing-key-file={w / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc",
            "--service-cluster-ip-range=10.96.0.0/16", "--allow-privileged=true",
            # kubectl logs/exec reach the kubelet by the name "localhost" (no DNS here)
            "--kubelet-preferred-address-types=Hostname",
            # the aggregation layer, for KEDA's external metrics
            f"--requestheader-client-ca-file={w / 'fp-ca.crt'}",
            "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={w / 'fp-client.crt'}",
            f"--proxy-client-key-file={w / 'fp-client.key'}"])
        server = f"https://127.0.0.1:{p['apiserver']}"
        self.kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "local",
            "clusters": [{"name": "local", "cluster": {
                "server": server, "insecure-skip-tls-verify": True}}],
            "users": [{"name": "admin", "user": {"token": TOKEN}}],
            "contexts": [{"name": "local", "context": {"cluster": "local", "user": "admin"}}],
        }))
        wait_for("the API server", lambda: (self.check_alive(), self.kubectl(
            "get", "--raw", "/readyz", check=False).strip() == "ok")[1], 120)
        kc = [f"--kubeconfig={self.kubeconfig}", f"--authentication-kubeconfig={self.kubeconfig}",
              f"--authorization-kubeconfig={self.kubeconfig}", "--leader-elect=false",
              "--bind-address=127.0.0.1"]
        self._spawn("kube-controller-manager", [
            str(b / "kube-controller-manager"), *kc, f"--secure-port={p['kcm']}",
            f"--service-account-private-key-file={w / 'sa.key'}",
            f"--root-ca-file={w / 'serving' / 'apiserver.crt'}",
            "--controllers=*,-nodeipam", f"--cert-dir={w / 'kcm'}"])
        self._spawn("kube-scheduler", [
            str(b / "kube-scheduler"), *kc, f"--secure-port={p['scheduler']}",
            f"--cert-dir={w / 'sched'}"])
        wait_for("the default ServiceAccount", lambda: (self.check_alive(), self.kubectl(
            "get", "serviceaccount", "default", check=False).startswith("NAME"))[1], 120)

    def _containerd(self) -> None:
        w = self.work
        root = self.containerd_root
        root.mkdir(parents=True, exist_ok=True)
        (w / "net.d").mkdir()
        (w / "net.d" / "10-rlbus.conflist").write_text(json.dumps({
            "cniVersion": "0.4.0", "name": CNI_NETWORK, "plugins": [{
                "type": "bridge", "bridge": CNI_BRIDGE, "isGateway": True, "ipMasq": False,
                "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.244.0.0/24"}]]}}]}))
        (w / "containerd.toml").write_text(f"""version = 2
root = "{root}"
state = "{w / 'containerd-state'}"
[grpc]
  address = "{self.containerd_sock}"
[ttrpc]
  address = "{self.containerd_sock}.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "{w / 'containerd-opt'}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  # CRI asks runc for oom_score_adj -998, which needs CAP_SYS_RESOURCE (not ours here):
  # every sandbox then fails with "can't get final child's PID from pipe: EOF".
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{w / 'net.d'}"
""")
        self._spawn("containerd", ["containerd", "--config", str(w / "containerd.toml")])
        wait_for("containerd", lambda: (self.check_alive(), self.ctr("version"))[1], 60)

    def import_image(self, name: str) -> bool:
        """Import a Docker image (`docker save | ctr images import -`) unless that image id
        was imported into this containerd root already: the root outlives the cluster, so
        the 6 GB rlbus image is copied once per build, not once per run. True if imported."""
        image_id = subprocess.run(["docker", "image", "inspect", "-f", "{{.Id}}", name],
                                  capture_output=True, text=True, check=True).stdout.strip()
        marker = self.containerd_root / f"imported-{name.replace('/', '_').replace(':', '_')}"
        listed = self.ctr("images", "ls", "-q").split()
        if marker.exists() and marker.read_text() == image_id and any(
                n.endswith(name) for n in listed):
            return False
        save = subprocess.Popen(["docker", "save", name], stdout=subprocess.PIPE)
        proc = subprocess.run(["ctr", "-a", str(self.containerd_sock), "-n", "k8s.io", "images",
                               "import", "-"], stdin=save.stdout, capture_output=True,
                              text=True, timeout=1800, check=False)
        save.wait(60)
        if proc.returncode != 0 or save.returncode != 0:
            raise RuntimeError(f"importing {name} failed: {proc.stderr}")
        marker.write_text(image_id)
        return True

    def _kubelet(self) -> None:
        w, p = self.work, self.ports
        (w / "kubelet.yaml").write_text(json.dumps({
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "cgroupDriver": "cgroupfs", "cgroupsPerQOS": False, "enforceNodeAllocatable": [],
            "failSwapOn": False, "failCgroupV1": False,
            "containerRuntimeEndpoint": f"unix://{self.containerd_sock}",
            "address": "127.0.0.1", "port": p["kubelet"], "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1", "healthzPort": p["kubelet_healthz"],
            "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"}, "evictionHard": {},
            "localStorageCapacityIsolation": False, "serializeImagePulls": False,
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
        }))

    def start_kubelet(self) -> None:
        """After the images are imported (the sandbox image must be there first)."""
        t0 = time.monotonic()
        w = self.work
        self._spawn("kubelet", [
            str(self.bin / "kubelet"), f"--kubeconfig={self.kubeconfig}",
            f"--config={w / 'kubelet.yaml'}", "--hostname-override=localhost",
            f"--root-dir={w / 'kubelet'}", f"--cert-dir={w / 'kpki'}"])

        def node_ready() -> bool:
            self.check_alive()
            nodes = self.get("nodes")["items"]
            return any(c["type"] == "Ready" and c["status"] == "True"
                       for n in nodes for c in n["status"].get("conditions", []))

        wait_for("the node to be Ready", node_ready, 120)
        self.timings["kubelet"] = round(time.monotonic() - t0, 1)

    # -- KEDA

    def start_keda(self, namespace: str) -> None:
        t0 = time.monotonic()
        crds = self.bin / "keda-crds"
        self.kubectl("apply", "--server-side", "-f", str(crds))  # too big for a client apply
        # the operator's watches fail for good on a CRD that is not served yet
        self.kubectl("wait", "--for=condition=Established", "crd", "--all", "--timeout=60s")
        certs = self.work / "keda-certs"
        p = self.ports
        env = {"KUBECONFIG": str(self.kubeconfig), "WATCH_NAMESPACE": namespace,
               "KEDA_CLUSTER_OBJECT_NAMESPACE": "keda", "POD_NAMESPACE": "keda"}
        self._spawn("keda", [
            str(self.bin / "keda"), "--leader-elect=false",
            f"--metrics-bind-address=127.0.0.1:{p['keda_metrics']}",
            f"--health-probe-bind-address=127.0.0.1:{p['keda_health']}",
            f"--metrics-service-bind-address=127.0.0.1:{p['keda_grpc']}",
            f"--cert-dir={certs}", f"--ca-dir={certs}"], env)
        kc = str(self.kubeconfig)
        self._spawn("keda-adapter", [
            str(self.bin / "keda-adapter"), f"--lister-kubeconfig={kc}", f"--kubeconfig={kc}",
            f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
            f"--secure-port={p['adapter']}", "--bind-address=127.0.0.1",
            f"--cert-dir={certs}", f"--tls-cert-file={certs / 'tls.crt'}",
            f"--tls-private-key-file={certs / 'tls.key'}",
            f"--metrics-service-address=localhost:{p['keda_grpc']}",
            f"--port={p['adapter_metrics']}"], env)
        # The aggregator dials the APIService's Service by name without aggregator routing:
        # an ExternalName to localhost is the one route to a host process (a loopback
        # EndpointSlice is refused).
        self.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                            "items": [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "keda"}},
            {"apiVersion": "v1", "kind": "Service",
             "metadata": {"name": "keda-metrics-apiserver", "namespace": "keda"},
             "spec": {"type": "ExternalName", "externalName": "localhost",
                      "ports": [{"name": "https", "port": p["adapter"]}]}},
            {"apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService",
             "metadata": {"name": "v1beta1.external.metrics.k8s.io"},
             "spec": {"service": {"namespace": "keda", "name": "keda-metrics-apiserver",
                                  "port": p["adapter"]},
                      "group": "external.metrics.k8s.io", "version": "v1beta1",
                      "insecureSkipTLSVerify": True, "groupPriorityMinimum": 100,
                      "versionPriority": 100}}]}))

        def available() -> bool:
            self.check_alive()
            conditions = self.get("apiservice", "v1beta1.external.metrics.k8s.io")["status"]
            return any(c["type"] == "Available" and c["status"] == "True"
                       for c in conditions.get("conditions", []))

        wait_for("KEDA's external metrics API", available, 120)
        self.timings["keda"] = round(time.monotonic() - t0, 1)

    # -- stop

    def stop(self) -> None:
        """Undo start(), whatever part of it ran; every step runs even if one fails."""
        steps: list[tuple[str, Callable[[], None]]] = [
            ("delete workloads", self._delete_workloads),
            ("stop KEDA", lambda: [self._kill(n) for n in ("keda-adapter", "keda")]),
            ("stop kubelet", lambda: self._kill("kubelet")),
            ("stop control plane", lambda: [self._kill(n) for n in (
                "kube-controller-manager", "kube-scheduler", "kube-apiserver", "etcd")]),
            ("kill leftover tasks", self._kill_tasks),
            ("stop containerd", lambda: self._kill("containerd")),
            ("unmount", self._unmount),
            ("network", self._remove_network),
            ("work folder", self._remove_work),
        ]
        errors = []
        for what, step in steps:
            try:
                step()
            except Exception as exc:
                errors.append(f"{what}: {exc!r}")
        if errors:
            print("cluster cleanup:", *errors, sep="\n  ")

    def _delete_workloads(self) -> None:
        if "kube-apiserver" not in self.procs or "kubelet" not in self.procs:
            return
        # The APIService first: a stale one breaks discovery for every client. Then the
        # ScaledObjects while the operator still runs (their finalizer needs it).
        self.kubectl("delete", "apiservice", "v1beta1.external.metrics.k8s.io",
                     "--ignore-not-found", check=False, timeout=60)
        if "keda" in self.procs:
            self.kubectl("delete", "scaledobjects", "--all", "-A", "--wait", "--timeout=60s",
                         check=False, timeout=90)
        for kind in ("deployments", "statefulsets", "jobs", "pods"):
            self.kubectl("delete", kind, "--all", "-A", "--grace-period=5", "--wait=false",
                         check=False, timeout=60)
        with contextlib.suppress(TimeoutError):
            wait_for("every pod gone", lambda: not self.get("pods", "-A")["items"], 120, 1)

    def _kill_tasks(self) -> None:
        if "containerd" not in self.procs:
            return
        # The shims outlive containerd: end their tasks while it still answers.
        for task in self.ctr("tasks", "ls", "-q", check=False).split():
            self.ctr("tasks", "kill", "-s", "SIGKILL", task, check=False)
        with contextlib.suppress(TimeoutError):
            wait_for("tasks stopped", lambda: "RUNNING" not in self.ctr(
                "tasks", "ls", check=False), 30)
        for task in self.ctr("tasks", "ls", "-q", check=False).split():
            self.ctr("tasks", "delete", "-f", task, check=False)
        for container in self.ctr("containers", "ls", "-q", check=False).split():
            self.ctr("containers", "rm", container, check=False)

    def _unmount(self) -> None:
        mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
        mine = [m for m in mounts if m.startswith(str(self.work))
                or m.startswith(str(self.containerd_root))]
        for mount in sorted(mine, key=len, reverse=True):  # the deepest first
            subprocess.run(["umount", "-l", mount], check=False, capture_output=True)

    def _remove_work(self) -> None:
        """The daemons' logs go to ``logs_to`` (the last run's, for a look after a failure)."""
        for f in self._log_files:
            f.close()
        if self.logs_to is not None:
            shutil.rmtree(self.logs_to, ignore_errors=True)
            shutil.copytree(self.logs, self.logs_to)
        shutil.rmtree(self.work, ignore_errors=True)

    def _remove_network(self) -> None:
        subprocess.run(["ip", "link", "del", CNI_BRIDGE], check=False, capture_output=True)
        subprocess.run(["rm", "-rf", f"/var/lib/cni/networks/{CNI_NETWORK}"], check=False)
