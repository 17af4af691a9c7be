// A c10d Backend that forwards every operation to the current generation of one of
// trainmover's groups.
//
// Why C++: torch's DeviceMesh, DTensor, FSDP2 and functional collectives reach a process
// group's backend through ProcessGroup::getBackend(device), a C++ Backend registered once
// per device; registering another backend later does not replace it. A Python ProcessGroup
// subclass is therefore not enough. Instead the ProcessGroup a user holds keeps this one
// forwarding backend for its whole life, and trainmover swaps what it forwards to
// (`set_inner`) at a step boundary, when no operation of the old generation is pending.
//
// The forwarding keeps trainmover's doomed-step rule on torch's code paths: a wait on any
// operation watches the worker's abort Signal. Inside a step an abort (or a failed
// operation) dooms the step: waits return at once, leaving output tensors as they are, and
// later operations are not issued at all; the commit vote then answers "not committed".
// Outside a step the wait raises instead. Futures (DDP's comm hooks wait on them) are
// completed the same way, so no thread stays blocked on a dead or hung peer.
//
// A sandbox forwarder (a standby's warm-up) has no inner backend: it answers every
// operation locally (see `Local*` below) and never touches the network. With a replay
// loaded (`set_replay`) it answers from a recording instead: the outputs the job's own
// worker of that role got for the same operations (`start_recording`/`take_recording`),
// so a warm-up sees real values (a pipeline stage's shapes, exchanged as pickled objects,
// must be real) and runs the code paths the job runs.
// torch/python.h, not torch/extension.h: the module needs the Python bindings and c10d, not
// the whole C++ frontend, whose headers were a sixth of this file's build (60 s -> 51 s)
#include <torch/python.h>
#include <pybind11/stl.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <ATen/core/ivalue.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <functional>
#include <thread>

#include "world.h"

namespace py = pybind11;

namespace trainmover {

using c10d::Backend;
using c10d::OpType;
using c10d::Work;
using WorkPtr = c10::intrusive_ptr<Work>;

class ForwardWork;

// The abort state of one worker, shared by all its forwarders (mirrors the Python
// AbortSignal: the watcher thread sets it; the runtime sets in_step around a step body).
class Signal {
 public:
  void set(const std::string& reason) {
    std::vector<c10::weak_intrusive_ptr<Work>> pending;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!aborted_.load()) {
        reason_ = reason;
      }
      aborted_.store(true);
      pending.swap(pending_);
    }
    finish_pending(pending);
    notify();
  }

  // Blocking waits sleep on one condition variable, woken by every completion and by the
  // signal: no polling, so a waiting thread takes no CPU from the computing ones (two
  // cores, several workers). The timed wait only bounds a wake-up that went missing.
  template <typename Pred>
  void sleep_until(Pred&& ready) {
    std::unique_lock<std::mutex> lock(wake_mutex_);
    while (!ready()) {
      wake_cv_.wait_for(lock, std::chrono::milliseconds(50));
    }
  }
  void notify() {
    { std::lock_guard<std::mutex> lock(wake_mutex_); }
    wake_cv_.notify_all();
  }
  void clear() {
    std::lock_guard<std::mutex> lock(mutex_);
    aborted_.store(false);
    reason_.clear();
  }
  bool is_set() const { return aborted_.load(); }
  std::string reason() {
    std::lock_guard<std::mutex> lock(mutex_);
    return reason_;
  }
  bool in_step() const { return in_step_.load(); }
  void set_in_step(bool v) { in_step_.store(v); }

  // A work whose future someone may wait on: completed (doomed) when the signal is set.
  // Returns false when the signal is already set (the caller finishes the work itself).
  bool track(const c10::intrusive_ptr<Work>& work) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (aborted_.load()) {
      return false;
    }
    if (pending_.size() > 64) {  // drop references to works long finished
      std::vector<c10::weak_intrusive_ptr<Work>> alive;
      for (auto& w : pending_) {
        if (w.use_count() > 0) alive.push_back(w);
      }
      pending_.swap(alive);
    }
    pending_.emplace_back(work);
    return true;
  }

 private:
  void finish_pending(std::vector<c10::weak_intrusive_ptr<Work>>& pending);

  std::mutex mutex_;
  std::mutex wake_mutex_;
  std::condition_variable wake_cv_;
  std::atomic<bool> aborted_{false};
  std::atomic<bool> in_step_{false};
  std::string reason_;
  std::vector<c10::weak_intrusive_ptr<Work>> pending_;
};

// Operation counts of one generation (which groups stay usable after an aborted step is
// decided from them: every member must agree on the sequence of operations).
struct Counts {
  std::atomic<int64_t> coll{0}, sent{0}, recv{0}, pending{0};
};

// One thread per forwarder that blocks in point-to-point waits (gloo's send/recv works
// complete only inside wait()), so the waiting thread can watch the signal meanwhile.
struct WaitBox {
  std::atomic<bool> done{false};
  std::exception_ptr error;
  std::shared_ptr<Signal> signal;   // told when done
};

class Waiter {
 public:
  Waiter() : state_(std::make_shared<State>()) {
    auto state = state_;
    std::thread([state] {
      while (true) {
        std::pair<WorkPtr, std::shared_ptr<WaitBox>> item;
        {
          std::unique_lock<std::mutex> lock(state->mutex);
          state->cv.wait(lock, [&] { return !state->queue.empty(); });
          item = std::move(state->queue.front());
          state->queue.pop_front();
        }
        try {
          item.first->wait();
        } catch (...) {
          item.second->error = std::current_exception();
        }
        item.second->done.store(true);
        item.second->signal->notify();
      }
    }).detach();  // a wait abandoned on abort stays blocked until gloo's own timeout
  }
  std::shared_ptr<WaitBox> submit(const WorkPtr& work, std::shared_ptr<Signal> signal) {
    auto box = std::make_shared<WaitBox>();
    box->signal = std::move(signal);
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      state_->queue.emplace_back(work, box);
    }
    state_->cv.notify_one();
    return box;
  }

 private:
  struct State {
    std::mutex mutex;
    std::condition_variable cv;
    std::deque<std::pair<WorkPtr, std::shared_ptr<WaitBox>>> queue;
  };
  std::shared_ptr<State> state_;
};

std::string op_name(OpType op) { return c10d::opTypeToString(op); }

// Set while the composed world group runs its operations on the axis forwarders: those
// belong to the world operation (recorded there, once), not to the axis groups' tapes, so a
// replay of either finds its own operations in order.
thread_local bool t_composing = false;

struct Composing {
  Composing() { t_composing = true; }
  ~Composing() { t_composing = false; }
};

using Compose = std::function<WorkPtr(ComposedWorld&)>;

// One forwarder's operations in issue order, with copies of their outputs once they
// completed: what the recording worker keeps for the standbys' replay. An output larger
// than `max_bytes` is kept as its shape only (a "meta" tensor): a replay answers it
// locally; the values that steer code (sizes, pickled objects, norms, votes) are small.
struct TapeEntry {
  OpType op;
  std::vector<at::Tensor> tensors;
  bool filled = false;
};

struct Tape {
  std::mutex mutex;
  std::vector<TapeEntry> entries;
  int64_t max_bytes = 0;

  size_t add(OpType op, bool filled) {
    std::lock_guard<std::mutex> lock(mutex);
    entries.push_back(TapeEntry{op, {}, filled});
    return entries.size() - 1;
  }
  void fill(size_t index, const std::vector<at::Tensor>& outputs) {
    std::vector<at::Tensor> copies;
    for (auto& t : outputs) {
      if (t.numel() * static_cast<int64_t>(t.element_size()) > max_bytes) {
        copies.push_back(at::empty(t.sizes(), t.options().device(at::kMeta)));
      } else {
        copies.push_back(t.detach().to(at::kCPU, /*non_blocking=*/false, /*copy=*/true));
      }
    }
    std::lock_guard<std::mutex> lock(mutex);
    if (index < entries.size()) {
      entries[index].tensors = std::move(copies);
      entries[index].filled = true;
    }
  }
};

bool has_outputs(OpType op) { return op != OpType::SEND && op != OpType::BARRIER; }

class ForwardWork : public Work {
 public:
  ForwardWork(WorkPtr inner, OpType op, std::shared_ptr<Signal> signal,
              std::shared_ptr<Counts> counts, std::shared_ptr<Waiter> waiter, bool p2p,
              std::vector<at::Tensor> outputs, std::string group)
      : Work(-1, op),
        p2p_(p2p),
        inner_(std::move(inner)),
        op_(op),
        signal_(std::move(signal)),
        counts_(std::move(counts)),
        waiter_(std::move(waiter)),
        outputs_(std::move(outputs)),
        group_(std::move(group)) {
    done_.store(inner_ == nullptr);  // a doomed or local operation: nothing was issued
  }

  bool isCompleted() override {
    return done_.load() || inner_->isCompleted();
  }
  bool isSuccess() const override { return true; }
  std::vector<at::Tensor> result() override { return outputs_; }
  void synchronize() override {
    if (inner_ && !doomed_.load()) inner_->synchronize();
  }

  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override {
    if (done_.load()) {
      return true;
    }
    try {
      // An operation already done (a short spin on isCompleted) is waited on here. One
      // whose inner work has a future (gloo's collectives but two) is waited on through it:
      // its completion callback wakes this thread, or the signal does. Anything else is
      // waited on by the helper thread while this one sleeps until that wait ends or the
      // signal is set: gloo's send/recv and its _reduce_scatter_base (2.13) complete only
      // inside wait(), and a blocked wait() could not watch the signal. The future path
      // saves the helper's two thread hand-offs per operation: FSDP2 waits on about
      // fifteen collectives a step.
      bool completed = false;
      for (int i = 0; !p2p_ && i < 32 && !(completed = inner_->isCompleted()); ++i) {
        if (signal_->is_set()) throw Aborted{};
      }
      c10::intrusive_ptr<c10::ivalue::Future> future;
      if (!completed && !p2p_) future = inner_future();
      if (completed) {
        inner_->wait(timeout);
      } else if (future) {
        auto ended = std::make_shared<std::atomic<bool>>(false);
        auto signal = signal_;
        future->addCallback([ended, signal](c10::ivalue::Future&) {
          ended->store(true);
          signal->notify();
        });
        signal_->sleep_until([&] { return ended->load() || done_.load() || signal_->is_set(); });
        if (done_.load()) return true;
        if (!ended->load()) throw Aborted{};
        inner_->wait(timeout);   // ended: returns at once, or raises the operation's error
      } else {
        auto box = waiter_->submit(inner_, signal_);
        signal_->sleep_until(
            [&] { return box->done.load() || done_.load() || signal_->is_set(); });
        if (done_.load()) return true;
        if (!box->done.load()) throw Aborted{};
        if (box->error) std::rethrow_exception(box->error);
      }
    } catch (const Aborted&) {
      return finish_or_throw(signal_->reason());
    } catch (const std::exception& e) {
      // a failed operation inside a step dooms the step (every other wait ends too)
      if (signal_->in_step()) {
        signal_->set(std::string(op_name(op_)) + " on " + group_ + " failed: " + e.what());
        return finish_or_throw(signal_->reason());
      }
      finish(false);
      throw;
    }
    finish(false);
    return true;
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    {
      std::lock_guard<std::mutex> lock(future_mutex_);
      if (future_) {
        return future_;
      }
      future_ = c10::make_intrusive<c10::ivalue::Future>(
          c10::ListType::create(c10::TensorType::get()));
    }
    if (done_.load()) {
      complete_future();
      return future_;
    }
    // (no lock held: a completed inner future runs the callback inline). The callback holds
    // the work: DDP keeps only the future, and the work must live to complete it.
    auto self = c10::intrusive_ptr<ForwardWork>::reclaim_copy(this);
    inner_->getFuture()->addCallback([work = self](c10::ivalue::Future& f) {
      if (work->done_.load()) {
        // doomed earlier: the operation's late end (often an error once its peer is gone)
        // belongs to an abandoned step and must not doom the step running now
        return;
      }
      if (f.hasError()) {
        auto& signal = work->signal_;
        if (signal->in_step()) {
          signal->set(std::string(op_name(work->op_)) + " on " + work->group_ +
                      " failed: " + f.tryRetrieveErrorMessage());
        } else {
          work->fail_future(f.exception_ptr());
        }
        return;
      }
      work->finish(false);
    });
    if (!signal_->track(c10::intrusive_ptr<Work>(self))) {
      doom();
    }
    return future_;
  }

  // The inner work's future, where it has one (gloo's send/recv works do not).
  c10::intrusive_ptr<c10::ivalue::Future> inner_future() {
    try {
      return inner_->getFuture();
    } catch (const std::exception&) {
      return {};
    }
  }

  void record_into(std::shared_ptr<Tape> tape, size_t index) {
    tape_ = std::move(tape);
    tape_index_ = index;
  }

  // The signal was set: a wait inside a step returns, outside a step it raises.
  void doom() {
    if (signal_->in_step()) {
      finish(true);
    } else {
      fail_future(std::make_exception_ptr(
          std::runtime_error("trainmover: " + std::string(op_name(op_)) + " on " + group_ +
                             " abandoned: " + signal_->reason())));
    }
  }

 private:
  struct Aborted {};

  bool finish_or_throw(const std::string& reason) {
    if (signal_->in_step()) {
      finish(true);
      return true;
    }
    TORCH_CHECK(false, "trainmover: ", op_name(op_), " on ", group_, " abandoned: ", reason);
  }

  void finish(bool doomed) {
    bool expected = false;
    if (!done_.compare_exchange_strong(expected, true)) {
      return;
    }
    doomed_.store(doomed);
    if (!doomed) {
      counts_->pending.fetch_sub(1);  // a doomed operation stays pending: the group is dirty
      if (tape_) tape_->fill(tape_index_, outputs_);
    }
    complete_future();
    signal_->notify();
  }

  // Completes the future once, outside any lock (its callbacks run inline).
  void complete_future() {
    auto future = held_future();
    if (future && !future_set_.exchange(true)) {
      future->markCompleted(c10::IValue(outputs_));
    }
  }

  void fail_future(std::exception_ptr error) {
    auto future = held_future();
    if (future && !future_set_.exchange(true)) {
      future->setError(std::move(error));
    }
  }

  c10::intrusive_ptr<c10::ivalue::Future> held_future() {
    std::lock_guard<std::mutex> lock(future_mutex_);
    return future_;
  }

  bool p2p_;
  WorkPtr inner_;
  OpType op_;
  std::shared_ptr<Tape> tape_;   // recording: where this operation's outputs go
  size_t tape_index_ = 0;
  std::shared_ptr<Signal> signal_;
  std::shared_ptr<Counts> counts_;
  std::shared_ptr<Waiter> waiter_;
  std::vector<at::Tensor> outputs_;
  std::string group_;
  std::atomic<bool> done_{false};
  std::atomic<bool> doomed_{false};
  std::atomic<bool> future_set_{false};
  std::mutex future_mutex_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

void Signal::finish_pending(std::vector<c10::weak_intrusive_ptr<Work>>& pending) {
  for (auto& weak : pending) {
    if (auto work = weak.lock()) {
      static_cast<ForwardWork*>(work.get())->doom();
    }
  }
}

std::vector<at::Tensor> flat(const std::vector<std::vector<at::Tensor>>& lists) {
  std::vector<at::Tensor> out;
  for (auto& l : lists) out.insert(out.end(), l.begin(), l.end());
  return out;
}

class __attribute__((visibility("hidden"))) ForwardingBackend : public Backend {
 public:
  ForwardingBackend(int rank, int size, std::shared_ptr<Signal> signal, std::string name)
      : Backend(rank, size),
        signal_(std::move(signal)),
        name_(std::move(name)),
        counts_(std::make_shared<Counts>()) {}

  // The generation operations go to from now on (None: no communicator). Called only at a
  // step boundary, when nothing is pending on the old one.
  void set_inner(const py::object& backend) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (backend.is_none()) {
      inner_.reset();
    } else {
      auto* raw = backend.cast<Backend*>();
      inner_ = c10::intrusive_ptr<Backend>::reclaim_copy(raw);
    }
    counts_ = std::make_shared<Counts>();
    generation_ += 1;
  }
  void set_local(bool local) { local_ = local; }
  // why this group cannot communicate at all (a usage error, raised even inside a step)
  void set_unavailable(const std::string& why) {
    std::lock_guard<std::mutex> lock(mutex_);
    unavailable_ = why;
  }
  std::string unavailable() {
    std::lock_guard<std::mutex> lock(mutex_);
    return unavailable_;
  }
  // This world group runs its operations on `levels` ((axis forwarder, size, this worker's
  // rank in it), outermost axis first; see world.h); `refusal` says what to use instead of
  // an operation it cannot compose.
  void set_composed(const py::list& levels, const std::string& refusal) {
    std::vector<ComposedWorld::Level> parts;
    for (auto item : levels) {
      auto t = item.cast<py::tuple>();
      auto* raw = t[0].cast<Backend*>();
      parts.push_back({c10::intrusive_ptr<Backend>::reclaim_copy(raw), t[1].cast<int>(),
                       t[2].cast<int>()});
    }
    auto signal = signal_;
    auto world = std::make_shared<ComposedWorld>(
        std::move(parts), getRank(),
        [signal] { return signal->is_set() && signal->in_step(); });
    TORCH_CHECK(world->size() == getSize(), "trainmover: the axes compose a world of ",
                world->size(), ", not ", getSize());
    std::lock_guard<std::mutex> lock(mutex_);
    world_ = std::move(world);
    world_refusal_ = refusal;
  }
  py::dict counts() {
    auto c = current_counts();
    py::dict d;
    d["coll"] = c->coll.load();
    d["sent"] = c->sent.load();
    d["recv"] = c->recv.load();
    d["pending"] = c->pending.load();
    return d;
  }
  int64_t generation() { return generation_; }

  // Recording: every operation issued from now on, with its outputs once complete.
  void start_recording(int64_t max_bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    tape_ = std::make_shared<Tape>();
    tape_->max_bytes = max_bytes;
  }
  int64_t recorded() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!tape_) return 0;
    std::lock_guard<std::mutex> tape_lock(tape_->mutex);
    return static_cast<int64_t>(tape_->entries.size());
  }
  // The operations recorded so far, as (op, name, outputs or None when the operation never
  // completed); recording goes on in a fresh tape if `keep_going`, else it stops.
  py::list take_recording(bool keep_going) {
    std::shared_ptr<Tape> tape;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      tape = tape_;
      tape_.reset();
      if (tape && keep_going) {
        tape_ = std::make_shared<Tape>();
        tape_->max_bytes = tape->max_bytes;
      }
    }
    py::list out;
    if (!tape) return out;
    std::lock_guard<std::mutex> lock(tape->mutex);
    for (auto& e : tape->entries) {
      py::object tensors = py::none();
      if (e.filled) tensors = py::cast(e.tensors);
      out.append(py::make_tuple(static_cast<int>(e.op), op_name(e.op), tensors));
    }
    return out;
  }

  // Replay: local operations are answered from `entries` ((op, outputs or None) in issue
  // order) instead of locally, from the first one on. An operation that does not match its
  // entry (another kind, other shapes) is answered locally, as is every one after it, and
  // the replay notes why.
  void set_replay(const py::list& entries) {
    std::vector<TapeEntry> replay;
    for (auto item : entries) {
      auto tuple = item.cast<py::tuple>();
      TapeEntry e{static_cast<OpType>(tuple[0].cast<int>()), {}, false};
      if (!tuple[1].is_none()) {
        e.tensors = tuple[1].cast<std::vector<at::Tensor>>();
        e.filled = true;
      }
      replay.push_back(std::move(e));
    }
    std::lock_guard<std::mutex> lock(mutex_);
    replay_ = std::move(replay);
    replaying_ = true;
    cursor_ = 0;
    mismatch_.clear();
  }
  void clear_replay() {
    std::lock_guard<std::mutex> lock(mutex_);
    replay_.clear();
    replaying_ = false;
    cursor_ = 0;
  }
  // (operations answered from the replay so far, its length, the first mismatch or "")
  py::tuple replay_state() {
    std::lock_guard<std::mutex> lock(mutex_);
    return py::make_tuple(static_cast<int64_t>(cursor_),
                          static_cast<int64_t>(replay_.size()), mismatch_);
  }

  const std::string getBackendName() const override { return "trainmover"; }
  bool supportsCoalescing() const override { return false; }

  // Each operation: what it issues on the current generation, what it does locally (a
  // sandbox, a joiner before its first step), and, on a composed world group, how it runs
  // on the axis groups (none: refused there).
  WorkPtr broadcast(std::vector<at::Tensor>& t, const c10d::BroadcastOptions& o) override {
    return run(OpType::BROADCAST, t, [&](Backend& b) { return b.broadcast(t, o); }, [] {},
               [&](ComposedWorld& w) {
                 w.broadcast(t, o.rootRank);
                 return WorkPtr();
               });
  }
  WorkPtr allreduce(std::vector<at::Tensor>& t, const c10d::AllreduceOptions& o) override {
    return run(OpType::ALLREDUCE, t, [&](Backend& b) { return b.allreduce(t, o); }, [] {},
               [&](ComposedWorld& w) {
                 w.allreduce(t, o);
                 return WorkPtr();
               });
  }
  WorkPtr allreduce_coalesced(std::vector<at::Tensor>& t,
                              const c10d::AllreduceCoalescedOptions& o) override {
    return run(OpType::ALLREDUCE_COALESCED, t,
               [&](Backend& b) { return b.allreduce_coalesced(t, o); }, [] {},
               [&](ComposedWorld& w) {
                 w.allreduce(t, o);
                 return WorkPtr();
               });
  }
  WorkPtr reduce(std::vector<at::Tensor>& t, const c10d::ReduceOptions& o) override {
    return run(OpType::REDUCE, t, [&](Backend& b) { return b.reduce(t, o); }, [] {},
               [&](ComposedWorld& w) {
                 TORCH_CHECK(t.size() == 1, "trainmover: reduce of ", t.size(), " tensors");
                 w.reduce(t[0], o.rootRank, o);
                 return WorkPtr();
               });
  }
  WorkPtr allgather(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                    const c10d::AllgatherOptions& o) override {
    return run(OpType::ALLGATHER, flat(out),
               [&](Backend& b) { return b.allgather(out, in, o); }, [&] {
                 for (size_t i = 0; i < out.size(); ++i)
                   for (auto& t : out[i]) t.copy_(in[i]);
               },
               [&](ComposedWorld& w) {
                 for (size_t i = 0; i < out.size() && i < in.size(); ++i) {
                   auto all = w.gather_all(in[i]);
                   if (!all.defined()) break;
                   spread(all, out[i]);
                 }
                 return WorkPtr();
               });
  }
  WorkPtr _allgather_base(at::Tensor& out, at::Tensor& in,
                          const c10d::AllgatherOptions& o) override {
    return run(OpType::_ALLGATHER_BASE, {out},
               [&](Backend& b) { return b._allgather_base(out, in, o); },
               [&] { local_gather(out, in); },
               [&](ComposedWorld& w) {
                 auto all = w.gather_all(in);
                 if (all.defined()) out.copy_(all.view_as(out));
                 return WorkPtr();
               });
  }
  WorkPtr allgather_coalesced(std::vector<std::vector<at::Tensor>>& out,
                              std::vector<at::Tensor>& in,
                              const c10d::AllgatherOptions& o) override {
    return run(OpType::ALLGATHER_COALESCED, flat(out),
               [&](Backend& b) { return b.allgather_coalesced(out, in, o); }, [&] {
                 for (auto& l : out)
                   for (size_t i = 0; i < l.size() && i < in.size(); ++i) l[i].copy_(in[i]);
               },
               [&](ComposedWorld& w) {
                 // out[r][i]: rank r's input i
                 for (size_t i = 0; i < in.size(); ++i) {
                   auto all = w.gather_all(in[i]);
                   if (!all.defined()) break;
                   std::vector<at::Tensor> column;
                   for (auto& l : out) column.push_back(l.at(i));
                   spread(all, column);
                 }
                 return WorkPtr();
               });
  }
  WorkPtr allgather_into_tensor_coalesced(std::vector<at::Tensor>& out,
                                          std::vector<at::Tensor>& in,
                                          const c10d::AllgatherOptions& o) override {
    return run(OpType::COALESCED, out,
               [&](Backend& b) { return b.allgather_into_tensor_coalesced(out, in, o); },
               [&] {
                 for (size_t i = 0; i < out.size(); ++i) local_gather(out[i], in[i]);
               },
               [&](ComposedWorld& w) {
                 for (size_t i = 0; i < out.size() && i < in.size(); ++i) {
                   auto all = w.gather_all(in[i]);
                   if (!all.defined()) break;
                   out[i].copy_(all.view_as(out[i]));
                 }
                 return WorkPtr();
               });
  }
  WorkPtr gather(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                 const c10d::GatherOptions& o) override {
    return run(OpType::GATHER, flat(out), [&](Backend& b) { return b.gather(out, in, o); },
               [&] {
                 for (auto& l : out)
                   for (auto& t : l) t.copy_(in[0]);
               },
               [&](ComposedWorld& w) {
                 TORCH_CHECK(in.size() == 1, "trainmover: gather of ", in.size(), " tensors");
                 auto all = w.gather(in[0], static_cast<int>(o.rootRank));
                 if (all.defined() && !out.empty()) spread(all, out[0]);
                 return WorkPtr();
               });
  }
  WorkPtr scatter(std::vector<at::Tensor>& out, std::vector<std::vector<at::Tensor>>& in,
                  const c10d::ScatterOptions& o) override {
    return run(OpType::SCATTER, out, [&](Backend& b) { return b.scatter(out, in, o); }, [&] {
      if (!in.empty() && !in[0].empty()) out[0].copy_(in[0][getRank()]);
    },
               [&](ComposedWorld& w) {
                 TORCH_CHECK(out.size() == 1, "trainmover: scatter into ", out.size(),
                             " tensors");
                 static const std::vector<at::Tensor> none;
                 w.scatter(out[0], in.empty() ? none : in[0], static_cast<int>(o.rootRank));
                 return WorkPtr();
               });
  }
  WorkPtr reduce_scatter(std::vector<at::Tensor>& out,
                         std::vector<std::vector<at::Tensor>>& in,
                         const c10d::ReduceScatterOptions& o) override {
    return run(OpType::REDUCE_SCATTER, out,
               [&](Backend& b) { return b.reduce_scatter(out, in, o); }, [&] {
                 for (size_t i = 0; i < out.size(); ++i) out[i].copy_(in[i][getRank()]);
               },
               [&](ComposedWorld& w) {
                 for (size_t i = 0; i < out.size() && !signal_->is_set(); ++i) {
                   std::vector<at::Tensor> blocks;
                   for (auto& b : in.at(i)) blocks.push_back(b.contiguous().view(-1));
                   w.reduce_scatter(out[i], at::cat(blocks), o.reduceOp);
                 }
                 return WorkPtr();
               });
  }
  WorkPtr _reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                               const c10d::ReduceScatterOptions& o) override {
    return run(OpType::_REDUCE_SCATTER_BASE, {out},
               [&](Backend& b) { return b._reduce_scatter_base(out, in, o); },
               [&] { local_scatter(out, in); },
               [&](ComposedWorld& w) {
                 w.reduce_scatter(out, in, o.reduceOp);
                 return WorkPtr();
               });
  }
  WorkPtr reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& out,
                                          std::vector<at::Tensor>& in,
                                          const c10d::ReduceScatterOptions& o) override {
    return run(OpType::REDUCE_SCATTER_TENSOR_COALESCED, out,
               [&](Backend& b) { return b.reduce_scatter_tensor_coalesced(out, in, o); },
               [&] {
                 for (size_t i = 0; i < out.size(); ++i) local_scatter(out[i], in[i]);
               },
               [&](ComposedWorld& w) {
                 for (size_t i = 0; i < out.size() && !signal_->is_set(); ++i) {
                   w.reduce_scatter(out[i], in.at(i), o.reduceOp);
                 }
                 return WorkPtr();
               });
  }
  WorkPtr alltoall_base(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& out_splits,
                        std::vector<int64_t>& in_splits,
                        const c10d::AllToAllOptions& o) override {
    return run(OpType::ALLTOALL_BASE, {out},
               [&](Backend& b) { return b.alltoall_base(out, in, out_splits, in_splits, o); },
               [&] {
                 if (out.sizes() == in.sizes()) out.copy_(in);
               });
  }
  WorkPtr alltoall(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in,
                   const c10d::AllToAllOptions& o) override {
    return run(OpType::ALLTOALL, out, [&](Backend& b) { return b.alltoall(out, in, o); }, [&] {
      for (size_t i = 0; i < out.size() && i < in.size(); ++i)
        if (out[i].sizes() == in[i].sizes()) out[i].copy_(in[i]);
    });
  }
  WorkPtr barrier(const c10d::BarrierOptions& o) override {
    return run(OpType::BARRIER, {}, [&](Backend& b) { return b.barrier(o); }, [] {},
               [&](ComposedWorld& w) {
                 w.barrier();
                 return WorkPtr();
               });
  }
  WorkPtr send(std::vector<at::Tensor>& t, int dst, int tag) override {
    return run(OpType::SEND, t, [&](Backend& b) { return b.send(t, dst, tag); }, [] {},
               [&](ComposedWorld& w) { return w.send(t, dst, tag); });
  }
  WorkPtr recv(std::vector<at::Tensor>& t, int src, int tag) override {
    // a sandbox receive yields zeros: a warm-up must not run on uninitialised memory
    return run(OpType::RECV, t, [&](Backend& b) { return b.recv(t, src, tag); }, [&] {
      for (auto& x : t) x.zero_();
    },
               [&](ComposedWorld& w) { return w.recv(t, src, tag); });
  }
  WorkPtr recvAnysource(std::vector<at::Tensor>& t, int tag) override {
    return run(OpType::RECVANYSOURCE, t, [&](Backend& b) { return b.recvAnysource(t, tag); },
               [&] {
                 for (auto& x : t) x.zero_();
               });
  }
  void setTimeout(std::chrono::milliseconds timeout) override {
    auto b = current();
    if (b) b->setTimeout(timeout);
  }

 private:
  // the blocks of `all` (one per rank, in rank order) into `outs`
  static void spread(const at::Tensor& all, std::vector<at::Tensor>& outs) {
    auto blocks = all.chunk(static_cast<int64_t>(outs.size()));
    for (size_t r = 0; r < outs.size(); ++r) outs[r].copy_(blocks[r].view_as(outs[r]));
  }

  std::shared_ptr<ComposedWorld> composed() {
    std::lock_guard<std::mutex> lock(mutex_);
    return world_;
  }

  void local_gather(at::Tensor& out, const at::Tensor& in) {
    auto chunks = out.flatten().chunk(getSize());
    for (auto& c : chunks) c.copy_(in.flatten());
  }
  void local_scatter(at::Tensor& out, const at::Tensor& in) {
    out.flatten().copy_(in.flatten().chunk(getSize())[getRank()]);
  }

  std::shared_ptr<Counts> current_counts() {
    std::lock_guard<std::mutex> lock(mutex_);
    return counts_;
  }

  c10::intrusive_ptr<Backend> current() {
    std::lock_guard<std::mutex> lock(mutex_);
    return inner_;
  }

  template <typename Issue, typename Local>
  WorkPtr run(OpType op, std::vector<at::Tensor> outputs, Issue&& issue, Local&& local,
              const Compose& compose = nullptr) {
    auto counts = current_counts();
    if (signal_->is_set()) {
      // a doomed step issues nothing more; outside a step the caller hears why
      TORCH_CHECK(signal_->in_step(), "trainmover: ", op_name(op), " on ", name_,
                  " refused: ", signal_->reason());
      return done(op, std::move(outputs), counts);
    }
    if (local_) {
      if (replaying()) {
        replay(op, outputs, local);
      } else {
        local();
      }
      return done(op, std::move(outputs), counts);
    }
    auto world = composed();
    WorkPtr work;
    if (world) {
      TORCH_CHECK(static_cast<bool>(compose), "trainmover: ", op_name(op),
                  " on the world group is not supported: ", world_refusal_);
      try {
        Composing composing;
        work = compose(*world);
      } catch (const std::exception& e) {
        if (!signal_->in_step()) throw;
        signal_->set(std::string(op_name(op)) + " on " + name_ + " failed: " + e.what());
        return done(op, std::move(outputs), counts);
      }
      if (!work) {   // a composed collective: complete (or its step doomed) by now
        auto tape = current_tape();
        if (tape && !signal_->is_set()) {
          size_t index = tape->add(op, !has_outputs(op));
          if (has_outputs(op)) tape->fill(index, outputs);
        }
        return done(op, std::move(outputs), counts);
      }
    } else {
      auto inner = current();
      if (!inner) {
        std::string why = unavailable();
        if (why.empty() && signal_->in_step()) {
          // the communicator was released (aborted) during the step: the step is doomed
          signal_->set(std::string(op_name(op)) + " on " + name_ + ": communicator released");
          return done(op, std::move(outputs), counts);
        }
        TORCH_CHECK(false, "trainmover: ", op_name(op), " on group ", name_, ": ",
                    why.empty() ? "the group has no communicator in this process" : why);
      }
      counts = current_counts();
      try {
        work = issue(*inner);
      } catch (const std::exception& e) {
        if (!signal_->in_step()) throw;
        signal_->set(std::string(op_name(op)) + " on " + name_ + " failed: " + e.what());
        return done(op, std::move(outputs), counts);
      }
    }
    bool p2p = op == OpType::SEND || op == OpType::RECV || op == OpType::RECVANYSOURCE;
    (op == OpType::SEND ? counts->sent : p2p ? counts->recv : counts->coll).fetch_add(1);
    counts->pending.fetch_add(1);
    std::shared_ptr<Waiter> waiter;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!waiter_) waiter_ = std::make_shared<Waiter>();
      waiter = waiter_;
    }
    auto forward = c10::make_intrusive<ForwardWork>(work, op, signal_, counts, waiter, p2p,
                                                    std::move(outputs), name_);
    auto tape = current_tape();
    if (tape) {
      forward->record_into(tape, tape->add(op, !has_outputs(op)));
    }
    return forward;
  }

  // where this forwarder's operations are recorded, if they are (not while it serves a
  // composed world operation: see t_composing)
  std::shared_ptr<Tape> current_tape() {
    if (t_composing) return nullptr;
    std::lock_guard<std::mutex> lock(mutex_);
    return tape_;
  }

  bool replaying() {
    std::lock_guard<std::mutex> lock(mutex_);
    return replaying_;
  }

  template <typename Local>
  void replay(OpType op, std::vector<at::Tensor>& outputs, Local&& local) {
    // a replayed answer is written as a backend writes its results: raw data, outside
    // autograd (a pipeline stage receives into input buffers that require grad, where an
    // in-place copy under autograd is refused)
    at::NoGradGuard no_grad;
    TapeEntry entry;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      size_t index = cursor_++;
      if (index >= replay_.size()) {
        note_mismatch(op_name(op) + " #" + std::to_string(index) +
                      " is beyond the recording (" + std::to_string(replay_.size()) +
                      " operations)");
        local();
        return;
      }
      entry = replay_[index];
      std::string why;
      if (entry.op != op) {
        why = "is " + op_name(op) + " but the recording has " + op_name(entry.op);
      } else if (entry.filled && has_outputs(op)) {
        if (entry.tensors.size() != outputs.size()) {
          why = op_name(op) + " has " + std::to_string(outputs.size()) +
                " outputs, the recording " + std::to_string(entry.tensors.size());
        }
        for (size_t i = 0; why.empty() && i < outputs.size(); ++i) {
          if (entry.tensors[i].sizes() != outputs[i].sizes() ||
              entry.tensors[i].scalar_type() != outputs[i].scalar_type()) {
            why = op_name(op) + " output " + std::to_string(i) + " is " +
                  c10::str(outputs[i].sizes()) + " " + c10::toString(outputs[i].scalar_type()) +
                  ", the recording's " + c10::str(entry.tensors[i].sizes()) + " " +
                  c10::toString(entry.tensors[i].scalar_type());
          }
        }
      }
      if (!why.empty()) {
        note_mismatch("operation #" + std::to_string(index) + " " + why);
        local();
        return;
      }
    }
    local();  // what the recording does not hold (too large, never completed) stays local
    if (!entry.filled || !has_outputs(op)) return;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (!entry.tensors[i].is_meta()) outputs[i].copy_(entry.tensors[i]);
    }
  }

  // (mutex_ held) After a mismatch every later operation is answered locally: the replay
  // has lost its place, and a later entry of the same shape would hand over wrong values.
  void note_mismatch(const std::string& why) {
    if (mismatch_.empty()) mismatch_ = name_ + ": " + why;
    replaying_ = false;
  }

  WorkPtr done(OpType op, std::vector<at::Tensor> outputs, std::shared_ptr<Counts> counts) {
    return c10::make_intrusive<ForwardWork>(nullptr, op, signal_, counts, nullptr, false,
                                            std::move(outputs), name_);
  }

  std::shared_ptr<Signal> signal_;
  std::string name_;
  std::mutex mutex_;
  c10::intrusive_ptr<Backend> inner_;
  std::shared_ptr<Counts> counts_;
  std::shared_ptr<Waiter> waiter_;
  bool local_ = false;
  std::string unavailable_;
  std::shared_ptr<ComposedWorld> world_;   // a world group composed from the axis groups
  std::string world_refusal_;
  int64_t generation_ = 0;
  std::shared_ptr<Tape> tape_;        // recording, when set
  std::vector<TapeEntry> replay_;     // replay, when replaying_
  bool replaying_ = false;
  size_t cursor_ = 0;
  std::string mismatch_;
};

}  // namespace trainmover

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace trainmover;
  py::class_<Signal, std::shared_ptr<Signal>>(m, "Signal")
      .def(py::init<>())
      .def("set", &Signal::set)
      .def("clear", &Signal::clear)
      .def("is_set", &Signal::is_set)
      .def("reason", &Signal::reason)
      .def_property("in_step", &Signal::in_step, &Signal::set_in_step);
  py::class_<ForwardingBackend, c10d::Backend, c10::intrusive_ptr<ForwardingBackend>>(
      m, "ForwardingBackend")
      .def(py::init<int, int, std::shared_ptr<Signal>, std::string>())
      .def("set_inner", &ForwardingBackend::set_inner)
      .def("set_local", &ForwardingBackend::set_local)
      .def("set_unavailable", &ForwardingBackend::set_unavailable)
      .def("set_composed", &ForwardingBackend::set_composed)
      .def("counts", &ForwardingBackend::counts)
      .def("start_recording", &ForwardingBackend::start_recording)
      .def("recorded", &ForwardingBackend::recorded)
      .def("take_recording", &ForwardingBackend::take_recording, py::arg("keep_going"))
      .def("set_replay", &ForwardingBackend::set_replay)
      .def("clear_replay", &ForwardingBackend::clear_replay)
      .def("replay_state", &ForwardingBackend::replay_state)
      .def_property_readonly("generation", &ForwardingBackend::generation);
}
