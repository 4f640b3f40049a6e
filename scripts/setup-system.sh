#!/usr/bin/env bash
# Debian packages the test rigs use (namespaces, veth, tc, offload switches) and the C
# compiler that builds the benchmarks' native probe (benchmarks/native/limit_probe.c).
# Installs only what is missing, and only as root with apt-get; otherwise it says
# what is missing and the tests that need it skip with that reason.
set -eu
need=()
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v tc >/dev/null 2>&1 || need+=(iproute2)
command -v ethtool >/dev/null 2>&1 || need+=(ethtool)
command -v cc >/dev/null 2>&1 || need+=(gcc libc6-dev)  # libc and Linux headers too
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing ${need[*]} with apt-get"
    apt-get update -qq >/dev/null 2>&1 || true
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
else
    echo "setup: missing ${need[*]} (not root or no apt-get); namespace and native-probe tests will skip"
fi
