"""flashnb's benchmark: ``python -m bench`` answers "is flashnb worth it on my GPU and shapes?".

Modules, in the order a run uses them:

* ``cli``      -- options, the GPU and no-GPU paths, what is printed;
* ``env``      -- CUDA device detection before numba is imported, header facts;
* ``cases``    -- ``Case`` (one shape and option set), the quick set and the full sweep;
* ``flops``    -- the FlashAttention FLOP formula, written in code;
* ``impls``    -- every implementation (flashnb backends, materialised CuPy / PyTorch,
  PyTorch SDPA backends) behind one ``make(case, data, pass)`` interface;
* ``gpu``      -- events, synchronisation, L2 flush, peak-memory accounting, inputs;
* ``harness``  -- the one timing loop, and the sweep that never dies on a refusal;
* ``smoke``    -- flashnb against the oracle at toy sizes (also in the simulator);
* ``io_table`` -- reference.io_model's HBM traffic next to measured times;
* ``host``     -- the host time of one call (tiny shape, back-to-back calls);
* ``report``   -- terminal / Markdown / CSV / JSON writers and readers, the plot;
* ``decode``, ``varlen``, ``flex``, ``model`` -- the sections of ``--decode``, ``--varlen``, ``--flex`` and
  ``--model llama``, each its own table.

The developer tools (tile sweeps, the decode kernels' A/B, the model step's bound, profiler targets and readers,
SASS) are in ``tools/`` (``python -m tools.X``; tools/README.md).

This file imports nothing: ``python -m bench`` must be able to switch numba to
its simulator before numba is first imported.
"""
