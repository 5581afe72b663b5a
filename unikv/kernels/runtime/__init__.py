"""What every kernel family shares: launch helpers, programmatic dependent launch, host-side
argument checks, the Triton id arithmetic, the CPU interpreter's patch, the fenced private
entry points and the start-up width check."""
