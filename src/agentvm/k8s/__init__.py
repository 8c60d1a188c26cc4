"""agent-vm on Kubernetes (agent-sandbox v1beta1): ``render`` (an agent file -> objects),
``validate`` (against the vendored CRDs and core schemas, no cluster), ``cluster`` (claim,
exec, rm through the official client). docs/k8s.md."""
