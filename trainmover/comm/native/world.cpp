// The composed world group: see world.h for why and how.
#include "world.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace trainmover {

using c10d::Work;
using WorkPtr = c10::intrusive_ptr<Work>;

ComposedWorld::ComposedWorld(std::vector<Level> levels, int rank,
                             std::function<bool()> stopped)
    : levels_(std::move(levels)), rank_(rank), stopped_(std::move(stopped)) {
  for (auto& level : levels_) size_ *= level.size;
  mine_ = coords(rank_);
  for (size_t i = 0; i < levels_.size(); ++i) {
    TORCH_CHECK(mine_[i] == levels_[i].coord, "trainmover: world rank ", rank_,
                " is not at rank ", levels_[i].coord, " of its axis group ", i);
  }
}

std::vector<int> ComposedWorld::coords(int rank) const {
  TORCH_CHECK(rank >= 0 && rank < size_, "trainmover: rank ", rank,
              " is outside the world group of ", size_);
  std::vector<int> out(levels_.size());
  for (size_t i = levels_.size(); i-- > 0;) {
    out[i] = rank % levels_[i].size;
    rank /= levels_[i].size;
  }
  return out;
}

bool ComposedWorld::done(const WorkPtr& work) {
  work->wait();   // outside a step a failed or abandoned operation raises here
  return !stopped_();
}

void ComposedWorld::allreduce(std::vector<at::Tensor>& tensors,
                              const c10d::AllreduceOptions& opts) {
  for (auto it = levels_.rbegin(); it != levels_.rend(); ++it) {
    if (!done(it->group->allreduce(tensors, opts))) return;
  }
}

void ComposedWorld::barrier() {
  // after the barrier of axis i every worker of this worker's group on axes 0..i has
  // passed the barriers of the axes before: the last one is a barrier of the whole world
  for (auto it = levels_.rbegin(); it != levels_.rend(); ++it) {
    if (!done(it->group->barrier(c10d::BarrierOptions()))) return;
  }
}

void ComposedWorld::broadcast(std::vector<at::Tensor>& tensors, int root) {
  auto r = coords(root);
  // outermost first: the root's group on axis 0, then every group on axis 1 whose members
  // share the root's coordinates on the axes after it, and so on
  for (size_t i = 0; i < levels_.size(); ++i) {
    bool in = true;
    for (size_t j = i + 1; j < levels_.size(); ++j) in = in && mine_[j] == r[j];
    if (!in) continue;
    c10d::BroadcastOptions o;
    o.rootRank = r[i];
    if (!done(levels_[i].group->broadcast(tensors, o))) return;
  }
}

void ComposedWorld::reduce(at::Tensor& tensor, int root, const c10d::ReduceOptions& opts) {
  auto r = coords(root);
  std::vector<at::Tensor> partial{tensor.clone()};
  for (size_t i = levels_.size(); i-- > 0;) {
    c10d::ReduceOptions o = opts;
    o.rootRank = r[i];
    o.rootTensor = 0;
    if (!done(levels_[i].group->reduce(partial, o))) return;
    if (mine_[i] != r[i]) return;   // not the root of this axis: my share is in
  }
  tensor.copy_(partial[0]);
}

at::Tensor ComposedWorld::gather_all(const at::Tensor& input) {
  at::Tensor cur = input.detach().contiguous().view(-1);
  // innermost first: after axis i, the blocks of every worker that differs from this one
  // on axes i.. only, in rank order
  for (size_t i = levels_.size(); i-- > 0;) {
    auto buf = at::empty({cur.numel() * levels_[i].size}, cur.options());
    std::vector<std::vector<at::Tensor>> out{buf.chunk(levels_[i].size)};
    std::vector<at::Tensor> in{cur};
    if (!done(levels_[i].group->allgather(out, in, c10d::AllgatherOptions()))) return {};
    cur = buf;
  }
  return cur;
}

at::Tensor ComposedWorld::gather(const at::Tensor& input, int root) {
  auto r = coords(root);
  at::Tensor cur = input.detach().contiguous().view(-1);
  for (size_t i = levels_.size(); i-- > 0;) {
    c10d::GatherOptions o;
    o.rootRank = r[i];
    std::vector<at::Tensor> in{cur};
    if (mine_[i] == r[i]) {
      auto buf = at::empty({cur.numel() * levels_[i].size}, cur.options());
      std::vector<std::vector<at::Tensor>> out{buf.chunk(levels_[i].size)};
      if (!done(levels_[i].group->gather(out, in, o))) return {};
      cur = buf;
    } else {
      std::vector<std::vector<at::Tensor>> out;
      done(levels_[i].group->gather(out, in, o));
      return {};   // my blocks went to this axis's root, which goes on without me
    }
  }
  return cur;
}

void ComposedWorld::scatter(at::Tensor& out, const std::vector<at::Tensor>& blocks,
                            int root) {
  auto r = coords(root);
  int64_t n = out.numel();
  at::Tensor cur;
  if (rank_ == root) {
    std::vector<at::Tensor> flat;
    for (auto& b : blocks) flat.push_back(b.detach().contiguous().view(-1));
    cur = at::cat(flat);
  }
  int64_t below = size_;   // blocks held by a root at the current axis
  for (size_t i = 0; i < levels_.size(); ++i) {
    below /= levels_[i].size;
    bool in = true;
    for (size_t j = i + 1; j < levels_.size(); ++j) in = in && mine_[j] == r[j];
    if (!in) continue;
    c10d::ScatterOptions o;
    o.rootRank = r[i];
    auto mine = at::empty({below * n}, out.options());
    std::vector<at::Tensor> outs{mine};
    std::vector<std::vector<at::Tensor>> ins;
    if (mine_[i] == r[i]) {
      // the root of this axis holds its own and its peers' blocks (received on the axes
      // before, or its own input at the world's root)
      ins.push_back(cur.chunk(levels_[i].size));
    }
    if (!done(levels_[i].group->scatter(outs, ins, o))) return;
    cur = mine;
  }
  out.copy_(cur.view_as(out));
}

void ComposedWorld::reduce_scatter(at::Tensor& out, const at::Tensor& input,
                                   const c10d::ReduceOp& op) {
  std::vector<at::Tensor> buf{input.detach().contiguous().view(-1).clone()};
  c10d::AllreduceOptions o;
  o.reduceOp = op;
  allreduce(buf, o);
  if (stopped_()) return;
  out.copy_(buf[0].chunk(size_)[rank_].view_as(out));
}

std::pair<const ComposedWorld::Level*, int> ComposedWorld::route(int peer,
                                                                 const char* what) const {
  auto p = coords(peer);
  const Level* level = nullptr;
  int at = -1;
  for (size_t i = 0; i < levels_.size(); ++i) {
    if (p[i] == mine_[i]) continue;
    TORCH_CHECK(level == nullptr, "trainmover: ", what, " between world ranks ", rank_,
                " and ", peer, " is not supported: they share no axis group (point-to-point "
                "on the world group of a multi-axis layout runs over the axis group of the "
                "two workers)");
    level = &levels_[i];
    at = p[i];
  }
  TORCH_CHECK(level != nullptr, "trainmover: ", what, " from world rank ", rank_,
              " to itself");
  return {level, at};
}

WorkPtr ComposedWorld::send(std::vector<at::Tensor>& tensors, int peer, int tag) {
  auto [level, at] = route(peer, "send");
  return level->group->send(tensors, at, tag);
}

WorkPtr ComposedWorld::recv(std::vector<at::Tensor>& tensors, int peer, int tag) {
  auto [level, at] = route(peer, "recv");
  return level->group->recv(tensors, at, tag);
}

}  // namespace trainmover
