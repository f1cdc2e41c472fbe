// Cluster specs: whatever a spec file holds; what validates is planned and written out for
// Kubernetes and Slurm.
#include <cstddef>
#include <cstdint>
#include <string>

#include "deploy/cluster_spec.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  baton::deploy::cluster_spec spec;
  std::string why;
  if (!baton::deploy::parse_cluster_spec(std::string(reinterpret_cast<const char*>(data), size), "/base", &spec, &why)) {
    if (why.empty()) __builtin_trap();  // a refusal always says why
    return 0;
  }
  const auto plan = baton::deploy::plan_launch(spec, "/bin/baton", {spec.head().host, ""});
  for (const auto& n : plan) (void)baton::deploy::ssh_argv(spec, n.host, n);
  (void)baton::deploy::kubernetes_manifests(spec);
  (void)baton::deploy::slurm_script(spec);
  return 0;
}
