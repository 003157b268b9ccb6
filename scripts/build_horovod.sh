#!/usr/bin/env bash
# Build a Horovod 0.28.1 wheel (PyTorch + Gloo; NCCL on a GPU VM) against the torch in $PY's venv.
# The PyPI sdist does not build against torch 2.14 as is (see docs/install.md, "The Horovod build"): we patch
# the C++ standard (top level 17 so gloo links, torch extension 20 for torch's headers) and, on a
# CPU machine, force the "torch has CUDA" probe off. One fix to the bundled gloo and two to Horovod
# (the process-set device, the background thread's initialization errors; below).
# Usage: build_horovod.sh PYTHON OUT_DIR
set -euo pipefail
PY=${1:?python}; OUT=${2:?out dir}
HVD_VERSION=${HOROVOD_VERSION:-0.28.1}
work=$(mktemp -d /tmp/elasticyolo-hvd-build.XXXXXX)
trap 'rm -rf "$work"' EXIT
mkdir -p "$OUT"
"$PY" -m pip download -q --no-deps --no-binary :all: "horovod==$HVD_VERSION" -d "$work"
tar -xzf "$work"/horovod-"$HVD_VERSION".tar.gz -C "$work"
src="$work/horovod-$HVD_VERSION"
sed -i 's/^set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$src/CMakeLists.txt"
sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 20)/' "$src/horovod/torch/CMakeLists.txt"
grep -q '^set(CMAKE_CXX_STANDARD 17)' "$src/CMakeLists.txt" || { echo "build_horovod: C++17 patch did not apply" >&2; exit 1; }
grep -q 'CMAKE_CXX_STANDARD 20' "$src/horovod/torch/CMakeLists.txt" || { echo "build_horovod: C++20 patch did not apply" >&2; exit 1; }

# Gloo: a pair that fails must also fail an unbound-buffer send still queued on it. Unpatched, a
# send left in the pair's queue (its socket shut by the collective abort, or the peer gone) is not
# told, and its waitSend sleeps out the whole Gloo timeout (seen: the survivor of a lost node stuck
# 30 s in an allreduce although all its connections were shut; docs/horovod-engine.md).
"$PY" - "$src/third_party/gloo/gloo/transport/tcp/pair.cc" <<'EOF'
import sys
path = sys.argv[1]
text = open(path).read()
old = """  for (auto& op : tx_) {
    if (op.buf != nullptr) {
      op.buf->signalException(ex);
    }
  }"""
new = """  for (auto& op : tx_) {
    if (op.buf != nullptr) {
      op.buf->signalException(ex);
    }
    if (op.getOpcode() == Op::SEND_UNBOUND_BUFFER) {
      NonOwningPtr<UnboundBuffer> ubuf(op.ubuf);
      if (ubuf) {
        ubuf->signalException(ex);
      }
    }
  }"""
if text.count(old) != 1:
    sys.exit("build_horovod: gloo unbound-send patch did not apply")
open(path, "w").write(text.replace(old, new))
EOF

# Horovod: a process set's Gloo device (the global set's too) takes the interface of its own, never
# set, context and so binds to whatever the host name resolves to (127.0.1.1 on a stock Debian
# node) instead of HOROVOD_GLOO_IFACE: multi-host collectives then fail with "connect refused".
# It must use the global context's interface (tests/test_partition.py checks it, nodes in netns).
"$PY" - "$src/horovod/common/gloo/gloo_context.cc" <<'EOF'
import sys
path = sys.argv[1]
text = open(path).read()
old = """  attr device_attr;
  device_attr.iface = gloo_iface_;
  device_attr.ai_family = AF_UNSPEC;
  auto dev = CreateDevice(device_attr);

  global_ctx = global_context.ctx;"""
new = """  gloo_iface_ = global_context.gloo_iface_;
  attr device_attr;
  device_attr.iface = gloo_iface_;
  device_attr.ai_family = AF_UNSPEC;
  auto dev = CreateDevice(device_attr);

  global_ctx = global_context.ctx;"""
if text.count(old) != 1:
    sys.exit("build_horovod: process-set interface patch did not apply")
open(path, "w").write(text.replace(old, new))
EOF

# Horovod: a Gloo error while the background thread sets up a new world (a peer that does not
# publish its address within HOROVOD_GLOO_TIMEOUT_SECONDS: a slow joiner, a peer lost meanwhile)
# escapes that thread and aborts the worker (`terminate called after throwing an instance of
# 'gloo::IoException'`, SIGABRT). Caught, it fails `hvd.init()` instead, which the worker retries
# (engines/horovod/worker.py), registering for the next world like any worker after a failed
# collective. `horovod_shutdown` also clears the failure so that a later `hvd.init()` can succeed.
"$PY" - "$src/horovod/common/operations.cc" <<'EOF'
import sys
path = sys.argv[1]
text = open(path).read()
old_init = """  {
    global_gloo_context.Initialize(ParseGlooIface());
  }
  if (state.control_operation == LibType::GLOO) {
    // Initializes global controller
    state.process_set_table.Initialize(global_gloo_context);
  }"""
new_init = """  try {
    global_gloo_context.Initialize(ParseGlooIface());
    if (state.control_operation == LibType::GLOO) {
      // Initializes global controller
      state.process_set_table.Initialize(global_gloo_context);
    }
  } catch (const std::exception& ex) {
    LOG(ERROR) << "Horovod could not be initialized: " << ex.what();
    try {
      global_gloo_context.Finalize();
    } catch (const std::exception&) {
    }
    state.initialization_failed = true;
    return;
  }"""
old_shutdown = """    horovod_global.shut_down = false;
    horovod_global.initialization_done = false;
  }
}"""
new_shutdown = """    horovod_global.shut_down = false;
    horovod_global.initialization_done = false;
    horovod_global.initialization_failed = false;
  }
}"""
if text.count(old_init) != 1 or text.count(old_shutdown) != 1:
    sys.exit("build_horovod: background-thread initialization patch did not apply")
open(path, "w").write(text.replace(old_init, new_init).replace(old_shutdown, new_shutdown))
EOF

export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1
export HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=GLOO
MAKEFLAGS=-j$(nproc); export MAKEFLAGS CMAKE_POLICY_VERSION_MINIMUM=3.5
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && [ -n "${CUDA_HOME:-}" ]; then
  echo "build_horovod: GPU machine, building with NCCL" >&2
  export HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_LINK=SHARED
else
  unset HOROVOD_GPU_OPERATIONS HOROVOD_GPU_ALLREDUCE HOROVOD_GPU_BROADCAST HOROVOD_GPU || true
  # FindPytorch asks torch whether it was built with CUDA; a CUDA build of torch on a CPU box then
  # makes CMake hunt for a CUDA toolkit. Make the probe answer False.
  sed -i 's/print(True if ((torch.version.cuda is not None) and (CUDA_HOME is not None)) else False)/print(False)/' "$src/cmake/Modules/FindPytorch.cmake"
  grep -q 'CUDA_HOME; print(False)' "$src/cmake/Modules/FindPytorch.cmake" || { echo "build_horovod: CPU-only probe patch did not apply" >&2; exit 1; }
fi
(cd "$src" && "$PY" -m pip wheel -q --no-build-isolation --no-deps -w "$OUT" .)
ls "$OUT"/horovod-*.whl
