// The world group of a layout with two or more parallel axes, composed from the worker's
// axis groups instead of a communicator of its own.
//
// Why composed: a communicator over every worker would have to be rebuilt by every worker at
// each migration and recovery (the one-for-one replacement of any role changes it), which
// breaks the delta property (only the replaced role's groups move) and is O(N) work per
// event at 100K GPUs. The axis groups already move with every switch; an operation on the
// world is a sequence of operations on them, so the world follows every switch for free and
// costs nothing to a job that never uses it. The price: a world operation is synchronous
// (point-to-point aside), and a floating-point reduction sums in another order than a flat
// ring would (bit-identical across trainmover runs, not to a flat all-reduce's last bits).
//
// Global ranks are mixed-radix over the axes, outermost first (dp, then pp, then tp), and a
// worker's rank in an axis group is its coordinate on that axis, so every world operation
// decomposes exactly:
// - all-reduce, barrier: one per axis, every worker;
// - all-gather: one per axis from the innermost out, each over the blocks gathered so far;
// - gather and reduce: a tree, innermost axis first, only the workers that are the root's
//   on the axes done so far go on (each axis group decides as a whole);
// - broadcast and scatter: the mirror image, outermost axis first;
// - reduce-scatter: an all-reduce, then the worker's own block;
// - send/recv: over the one axis group the two workers share; other pairs are refused, as
//   are all-to-all and receive-from-any.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <functional>
#include <string>
#include <vector>

namespace trainmover {

class ComposedWorld {
 public:
  struct Level {
    c10::intrusive_ptr<c10d::Backend> group;   // this worker's group on one axis
    int size;
    int coord;                                 // this worker's rank in it
  };

  // `levels`: the axes of size > 1, outermost first. `stopped`: true once the step is
  // doomed (the sub-operations' waits returned without completing): issue nothing more.
  ComposedWorld(std::vector<Level> levels, int rank, std::function<bool()> stopped);

  // Synchronous: each returns once every sub-operation completed, or the step was doomed.
  void allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts);
  void barrier();
  void broadcast(std::vector<at::Tensor>& tensors, int root);
  void reduce(at::Tensor& tensor, int root, const c10d::ReduceOptions& opts);
  // every worker's `input`, in global rank order, flattened; undefined when doomed
  at::Tensor gather_all(const at::Tensor& input);
  // at `root`: every worker's input in rank order (undefined elsewhere or when doomed)
  at::Tensor gather(const at::Tensor& input, int root);
  // `root`'s `blocks` (one per rank, at the root only) into `out`
  void scatter(at::Tensor& out, const std::vector<at::Tensor>& blocks, int root);
  // the sum (op) over workers of `input` (size x the output's), this worker's block into out
  void reduce_scatter(at::Tensor& out, const at::Tensor& input, const c10d::ReduceOp& op);
  // a point-to-point operation with `peer` (a global rank), on the one axis group both share
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int peer, int tag);
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int peer, int tag);

  int size() const { return size_; }

 private:
  std::vector<int> coords(int rank) const;
  // waits on a sub-operation; false once the step is doomed
  bool done(const c10::intrusive_ptr<c10d::Work>& work);
  // the level on which `peer` alone differs from this worker, and its rank there
  std::pair<const Level*, int> route(int peer, const char* what) const;

  std::vector<Level> levels_;
  std::vector<int> mine_;
  int rank_;
  int size_ = 1;
  std::function<bool()> stopped_;
};

}  // namespace trainmover
