"""Runtime helpers beneath ops and kernels: devices, wrapper unwrapping, DTensor placements, function routing,
hub functions, sub-models, and the release refusal (is a patchset for this transformers)."""
