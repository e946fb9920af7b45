"""What every op shares: input validation (:mod:`.validation`) and a blocked LDLᵀ Triton kernel
(:mod:`.ldl_triton`).  Importing this package imports nothing."""
