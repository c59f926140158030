#!/usr/bin/env bash
# Checks deploy/k8s/ without a Kubernetes cluster (none is reachable here):
#  - every manifest validates against the Kubernetes 1.30 OpenAPI schemas (kubernetes-validate,
#    strict: unknown fields are errors);
#  - the wiring the README promises: worker replicas = the coordinator's mesh size, Parallel pod
#    management, the StatefulSet's serviceName is a headless Service that publishes not-ready
#    pods, every probe is `meshrun health` on the container's own gRPC port;
#  - the worker's start command, run by sh as the pod would run it, derives --rank from the pod
#    ordinal and advertises the pod's stable DNS name;
#  - the ConfigMap's Prometheus config passes `promtool check config`.
# Usage: k8s_manifests_test.sh WORK_DIR   (a Python venv with kubernetes-validate is made there)
set -euo pipefail
work="$1"
cd "$(dirname "$0")/../.."
venv="$work/k8s-venv"
if [ ! -x "$venv/bin/kubernetes-validate" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q kubernetes-validate==1.37.0
fi
"$venv/bin/kubernetes-validate" --strict --quiet -k 1.30.0 \
  deploy/k8s/coordinator.yaml deploy/k8s/workers.yaml deploy/k8s/prometheus.yaml

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$venv/bin/python" - "$tmp" <<'PY'
import math, os, re, subprocess, sys, yaml

tmp = sys.argv[1]
def load(path):
    return [d for d in yaml.safe_load_all(open(path)) if d]
docs = {}
for f in ("coordinator", "workers", "prometheus"):
    for d in load(f"deploy/k8s/{f}.yaml"):
        docs[(d["kind"], d["metadata"]["name"])] = d
failures = []
def check(cond, what):
    if not cond:
        failures.append(what)

coord = docs[("Deployment", "meshrun-coordinator")]["spec"]["template"]["spec"]["containers"][0]
mesh = next(a.split("=", 1)[1] for a in coord["command"] if a.startswith("--mesh="))
mesh_size = math.prod(int(kv.split("=")[1]) for kv in mesh.split(","))
sts = docs[("StatefulSet", "meshrun-worker")]["spec"]
check(sts["replicas"] == mesh_size, f"worker replicas {sts['replicas']} != mesh size {mesh_size} ({mesh})")
check(sts.get("podManagementPolicy") == "Parallel", f"podManagementPolicy is {sts.get('podManagementPolicy')}, expected Parallel")
svc = docs.get(("Service", sts["serviceName"]))
check(svc is not None and svc["spec"].get("clusterIP") == "None", f"serviceName {sts['serviceName']} is not a headless Service")
check(svc is not None and svc["spec"].get("publishNotReadyAddresses") is True, "headless Service does not publish not-ready pods")
check(docs[("Service", "meshrun-coordinator")]["spec"]["ports"][0]["port"] == 50051, "coordinator Service port is not 50051")

worker = sts["template"]["spec"]["containers"][0]
for name, c in (("coordinator", coord), ("worker", worker)):
    grpc_port = next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc")
    for probe in ("readinessProbe", "livenessProbe"):
        cmd = c[probe]["exec"]["command"]
        check(cmd[:2] == ["meshrun", "health"] and f"localhost:{grpc_port}" in cmd,
              f"{name} {probe} is {cmd}, expected meshrun health --addr localhost:{grpc_port}")

# Run the worker's command as the pod would, with a stand-in meshrun-worker that prints its argv.
shim = os.path.join(tmp, "meshrun-worker")
with open(shim, "w") as f:
    f.write('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
os.chmod(shim, 0o755)
for ordinal in (0, 5, 7):
    env = {"PATH": f"{tmp}:/usr/bin:/bin", "POD_NAME": f"meshrun-worker-{ordinal}"}
    argv = subprocess.run(worker["command"], env=env, check=True, capture_output=True, text=True).stdout.split("\n")
    check(f"--rank={ordinal}" in argv, f"pod meshrun-worker-{ordinal}: argv {argv} lacks --rank={ordinal}")
    check(f"--advertise_host=meshrun-worker-{ordinal}.meshrun-worker" in argv,
          f"pod meshrun-worker-{ordinal}: argv {argv} does not advertise meshrun-worker-{ordinal}.meshrun-worker")
    check("--coordinator=meshrun-coordinator:50051" in argv, f"argv {argv} lacks the coordinator Service address")

with open(os.path.join(tmp, "prometheus.yml"), "w") as f:
    f.write(docs[("ConfigMap", "meshrun-prometheus")]["data"]["prometheus.yml"])
if failures:
    print("FAIL:\n  " + "\n  ".join(failures))
    sys.exit(1)
print(f"k8s wiring ok: mesh {mesh} = {mesh_size} worker replicas, rank from pod ordinal")
PY
promtool check config "$tmp/prometheus.yml"
promtool check config deploy/prometheus/prometheus.yml
echo PASS
