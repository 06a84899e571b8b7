// A mixture-of-experts layer's expert linears on the CPU, all experts in one call: rows grouped by expert (counts[e]
// rows for expert e, in order) are multiplied by their expert's weight. The weights are packed once into panels of
// 16 output columns ([experts, N / 16, K, 16]) so that one expert's panel streams through the cache once per block of
// rows, and the (expert, panel) pairs are spread over the threads. fp32 only: bf16 models keep torch's path.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <vector>

#include "panel_gemm.h"

namespace {

using ferry::kPanel;
using ferry::RowMap;

struct Group {
  int64_t expert;
  int64_t first_row;
  int64_t rows;
};

std::vector<Group> groups_of(const torch::Tensor& counts) {
  std::vector<Group> groups;
  const int64_t* count = counts.data_ptr<int64_t>();
  int64_t first_row = 0;
  for (int64_t e = 0; e < counts.size(0); ++e) {
    if (count[e] > 0) groups.push_back({e, first_row, count[e]});
    first_row += count[e];
  }
  return groups;
}

template <typename T>
const T* optional_data(const c10::optional<torch::Tensor>& tensor, int64_t rows, const char* name) {
  if (!tensor.has_value()) return nullptr;
  TORCH_CHECK(tensor->dim() == 1 && tensor->size(0) == rows && tensor->is_contiguous(), name,
              " must be a contiguous vector with one entry per grouped row");
  return tensor->data_ptr<T>();
}

void check_inputs(const torch::Tensor& x, const torch::Tensor& counts, const torch::Tensor& packed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.stride(1) == 1, "x must be [rows, K] fp32");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == torch::kFloat32 && packed.is_contiguous() &&
                  packed.size(3) == kPanel && packed.size(2) == x.size(1),
              "packed weights must be [experts, N / 16, K, 16] fp32, contiguous");
  TORCH_CHECK(counts.dim() == 1 && counts.scalar_type() == torch::kInt64 && counts.size(0) == packed.size(0),
              "counts must hold one int64 per expert");
}

}  // namespace

// Grouped row r (rows grouped by expert: counts[e] of them for expert e, in order) is x[source[r]] (default: x[r]);
// its product with its expert's weight, times scale[r] (default 1), goes to y[destination[r]] (default: y[r]).
// x [*, K], packed [experts, N / 16, K, 16] → y [rows, N].
torch::Tensor grouped_linear(torch::Tensor x, torch::Tensor counts, torch::Tensor packed,
                             c10::optional<torch::Tensor> source, c10::optional<torch::Tensor> scale,
                             c10::optional<torch::Tensor> destination) {
  check_inputs(x, counts, packed);
  const std::vector<Group> groups = groups_of(counts);
  const int64_t rows = groups.empty() ? 0 : groups.back().first_row + groups.back().rows;
  TORCH_CHECK(source.has_value() || rows == x.size(0), "counts must add up to x's rows");
  const int64_t panels = packed.size(1), k_size = packed.size(2);
  torch::Tensor y = torch::empty({rows, panels * kPanel}, x.options());
  const RowMap map{x.data_ptr<float>(), x.stride(0), y.data_ptr<float>(), y.stride(0),
                   optional_data<int64_t>(source, rows, "source"),
                   optional_data<int64_t>(destination, rows, "destination"),
                   optional_data<float>(scale, rows, "scale")};
  const float* weights = packed.data_ptr<float>();
  at::parallel_for(0, static_cast<int64_t>(groups.size()) * panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const Group& group = groups[item / panels];
      const int64_t panel = item % panels;
      ferry::panel_row_range(map, group.first_row, group.first_row + group.rows,
                             weights + (group.expert * panels + panel) * k_size * kPanel, k_size, panel * kPanel);
    }
  });
  return y;
}

// Each token's k (expert, weight) choices as grouped rows: rows grouped by expert (by token within an expert), each
// with its token (source), its routing weight (scale) and its slot (destination: token * k + the expert's rank among
// the token's k, so that a token's slots hold its experts in ascending order). → (source, scale, destination, counts)
std::vector<torch::Tensor> group_by_expert(torch::Tensor experts, torch::Tensor weights, int64_t num_experts) {
  TORCH_CHECK(experts.dim() == 2 && experts.scalar_type() == torch::kInt64 && experts.is_contiguous(),
              "experts must be [tokens, k] int64, contiguous");
  TORCH_CHECK(weights.sizes() == experts.sizes() && weights.scalar_type() == torch::kFloat32 &&
                  weights.is_contiguous(), "weights must be [tokens, k] fp32, contiguous");
  const int64_t tokens = experts.size(0), k = experts.size(1), rows = tokens * k;
  const int64_t* expert = experts.data_ptr<int64_t>();
  const auto long_options = experts.options();
  torch::Tensor counts = torch::zeros({num_experts}, long_options);
  int64_t* count = counts.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows; ++i) {
    TORCH_CHECK(expert[i] >= 0 && expert[i] < num_experts, "expert index out of range");
    ++count[expert[i]];
  }
  std::vector<int64_t> next_row(num_experts, 0);
  for (int64_t e = 1; e < num_experts; ++e) next_row[e] = next_row[e - 1] + count[e - 1];
  torch::Tensor source = torch::empty({rows}, long_options), destination = torch::empty({rows}, long_options);
  torch::Tensor scale = torch::empty({rows}, weights.options());
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = expert[t * k + j];
      int64_t rank = 0;
      for (int64_t other = 0; other < k; ++other) rank += expert[t * k + other] < e;
      const int64_t row = next_row[e]++;
      source.data_ptr<int64_t>()[row] = t;
      destination.data_ptr<int64_t>()[row] = t * k + rank;
      scale.data_ptr<float>()[row] = weights.data_ptr<float>()[t * k + j];
    }
  }
  return {source, scale, destination, counts};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("grouped_linear", &grouped_linear, "rows grouped by expert times their expert's packed weight",
        py::arg("x"), py::arg("counts"), py::arg("packed"), py::arg("source") = py::none(),
        py::arg("scale") = py::none(), py::arg("destination") = py::none());
  m.def("group_by_expert", &group_by_expert, "a token's k expert choices as rows grouped by expert");
  m.def("panel_width", [] { return kPanel; });
}
