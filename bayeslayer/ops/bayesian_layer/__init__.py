"""The Bayesian Layer op and its design-model family, one file per job (docs/theory.md §1-§6).

Each Triton file stands next to its plain-PyTorch twin (``x.py`` / ``x_triton.py``)::

    recurrent.py              the recurrent oracle: exact filtering token by token, every write model
    prepare.py                argument preparation shared by every path (validate, cast, fold groups)
    write_models.py           how a token is written: one object per write model (bayes, diagonal, reset, latent;
                              lowrank in lowrank.py), its state size and prior state
    groups.py, transition.py  observation-noise groups folded into heads; the transition A_t
    chunk.py                  the chunked PyTorch path (covariance pass + WY/UT mean pass)
    chunk_triton.py           bl_chunk_triton: the autograd Functions and the public Triton entry point
    step_triton.py            bl_step_triton: one fused decoding step
    kernels_triton.py         the Triton kernels of the chunk passes and the step
    triton_support.py         what the Triton kernels run, and why not (no Triton import)
    scan.py / scan_triton.py  the covariance pass as an exact segment scan
    scan_backward.py / scan_backward_triton.py   its backward (B2-B4)
    scan_grad.py              the composed backward and the autograd Function over the scan
    mean_pass_fla.py          the mean pass on flash-linear-attention's kernels, and its backward
    lowrank.py                the low-rank-plus-diagonal precision write model (LowRankWrite) and its own filter
    cp.py                     context parallelism: one long sequence split across ranks

The public functions are re-exported by :mod:`bayeslayer.ops`; :mod:`bayeslayer.ops.backend` chooses
between the PyTorch and the Triton implementations.  Importing this package imports nothing (so no
Triton): the kernels are compiled on first call.  On a CPU set ``TRITON_INTERPRET=1`` before Triton is
first imported to run them in Triton's interpreter (how the tests run them).
"""
