// A logical device mesh with named axes, as jax.sharding.Mesh.
#ifndef MESHRUN_CORE_SHARDING_MESH_H_
#define MESHRUN_CORE_SHARDING_MESH_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "meshrun/v1/common.pb.h"

namespace meshrun {

// Devices (worker ranks 0..size-1) laid out row-major over named axes, exactly as
// mesh_utils.create_device_mesh(shape) does: on ('data': 2, 'model': 4), rank r has coordinates
// (r / 4, r % 4). Immutable value type; thread-compatible.
class Mesh {
 public:
  // The most devices a mesh may have (a worker process each), as the job config's mesh keys.
  static constexpr int kMaxDevices = 4096;

  Mesh() = default;
  // Errors: InvalidArgument for an empty axis name, a duplicate name, a size < 1, or more than
  // kMaxDevices devices.
  static absl::StatusOr<Mesh> Create(std::vector<std::pair<std::string, int>> axes);
  // Parses "data=2,model=4". Errors as Create, plus malformed text.
  static absl::StatusOr<Mesh> Parse(absl::string_view text);
  static absl::StatusOr<Mesh> FromProto(const v1::Mesh& proto);
  v1::Mesh ToProto() const;

  int num_axes() const { return static_cast<int>(axes_.size()); }
  const std::string& axis_name(int i) const { return axes_[i].first; }
  int axis_size(int i) const { return axes_[i].second; }
  // Index of `name`, or NotFound naming the axis and the mesh's axes.
  absl::StatusOr<int> AxisIndex(absl::string_view name) const;
  // Total number of devices.
  int size() const;

  // Coordinates of `rank` on every axis. REQUIRES: 0 <= rank < size().
  std::vector<int> Coords(int rank) const;
  int RankOf(const std::vector<int>& coords) const;
  // The ranks that share every coordinate with `rank` except on `axis`, in axis-index order:
  // the group a collective over `axis` runs in. Position i holds the device with axis_index i.
  std::vector<int> AxisGroup(int rank, int axis) const;
  // The ranks that share every coordinate with `rank` except on `axes`, ordered by the
  // coordinates on `axes` with the first listed axis major: a collective over several axes,
  // e.g. psum(x, ('i', 'j')). Position k is the device whose axis_index over `axes` is k.
  std::vector<int> AxesGroup(int rank, const std::vector<int>& axes) const;
  // Every group of a collective over `axes` (each rank in exactly one), each in ring order.
  std::vector<std::vector<int>> GroupsOver(const std::vector<int>& axes) const;
  // Every non-empty subset of the axes, in mesh order ({0}, {1}, {0, 1}, ...).
  std::vector<std::vector<int>> AxisSubsets() const;

  // Indices of `names`. Errors: NotFound naming the first unknown axis; InvalidArgument for a
  // repeated name.
  absl::StatusOr<std::vector<int>> AxisIndices(const std::vector<std::string>& names) const;

  // "Mesh('data': 2, 'model': 4)", as JAX prints it.
  std::string ToString() const;
  bool operator==(const Mesh& other) const { return axes_ == other.axes_; }
  bool operator!=(const Mesh& other) const { return !(*this == other); }

 private:
  std::vector<std::pair<std::string, int>> axes_;
};

}  // namespace meshrun

#endif  // MESHRUN_CORE_SHARDING_MESH_H_
