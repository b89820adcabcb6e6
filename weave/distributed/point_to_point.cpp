// Point-to-point messages: send, recv, isend, send_recv and wait_sends, with the guard's header
// that makes a receive of another dtype or shape raise instead of reading stale bytes.
#include <array>
#include <optional>

#include "weave/distributed/staging.h"
#include "weave/ops/ops.h"

namespace weave::dist {

using namespace detail;

namespace {
void check_peer(const Call& c, const Group::Impl& g, int peer) {
  WEAVE_CHECK(peer >= 0 && peer < static_cast<int>(g.ranks.size()) && peer != g.my_rank, c.name,
              "peer {} must be another rank of group {} (group ranks 0..{}, this is {})", peer,
              c.group.str(), g.ranks.size() - 1, g.my_rank);
}
}  // namespace

namespace {

// The guard of a point-to-point message (CheckMode::Guard and Full): a header with the sender's
// dtype and shape goes ahead of the payload on the group's host communicator, so a receive
// that does not match what was sent raises instead of leaving stale or reinterpreted bytes.
constexpr int kHeaderSize = 2 + kMaxDims;
using Header = std::array<int64_t, kHeaderSize>;

bool p2p_guarded() {
  return runtime().check != CheckMode::Off;
}

// One more message to or from group rank `peer` (set_check_mode's count of those in flight).
void count_message(const std::unique_ptr<std::atomic<int64_t>[]>& counts, const Group::Impl& g,
                   int peer) {
  counts[size_t(g.ranks[size_t(peer)])].fetch_add(1, std::memory_order_relaxed);
}

Header header_of(const Tensor& t) {
  Header h{};
  h[0] = static_cast<int64_t>(t.dtype());
  h[1] = t.dim();
  for (int d = 0; d < t.dim(); ++d) h[2 + d] = t.shape()[d];
  return h;
}

bool readable(const Header& h) {
  return h[0] >= 0 && h[0] <= static_cast<int64_t>(kBool) && h[1] >= 0 && h[1] <= kMaxDims;
}

std::string header_text(const Header& h) {
  if (!readable(h)) return "an unreadable header";
  return fmt::format("{} {}", static_cast<DType>(h[0]), Shape(h.data() + 2, int(h[1])));
}

// A tensor of what the sender described, to take its payload off the wire after a mismatch (so
// the channel stays in step); undefined for a shape no tensor can have.
Tensor drain_for(const Header& sent, Device device) {
  try {
    if (readable(sent))
      return empty(Shape(sent.data() + 2, int(sent[1])),
                   {.dtype = static_cast<DType>(sent[0]), .device = device});
  } catch (const Error&) {
  }
  return Tensor();
}

[[noreturn]] void fail_mismatch(const char* op, int src, const Header& sent,
                                const Header& expected) {
  WEAVE_FAIL(op,
             "group rank {} sent {}, but this rank receives {}; hint: the receiving tensor must "
             "have the sent dtype and shape",
             src, header_text(sent), header_text(expected));
}

// Receives the sender's header and checks it against `buffer`; on a mismatch, drains the
// payload and raises.
void receive_checked(Group::Impl& g, Communicator* route, const Tensor& buffer, int src, int tag) {
  Header sent{};
  g.comm->recv(sent.data(), kHeaderSize, kInt64, src, tag);
  const Header expected = header_of(buffer);
  if (sent == expected) return;
  const Tensor discard = drain_for(sent, buffer.device());
  if (discard.defined())
    route->recv(discard.data_ptr(), discard.numel(), discard.dtype(), src, tag);
  fail_mismatch("recv", src, sent, expected);
}

// The payloads cross as bytes: a receive of another dtype (drained after a mismatch) still pairs.
void exchange_bytes(Communicator* route, const Tensor& outgoing, int dst, const Tensor& incoming,
                    int src, int tag) {
  route->send_recv(outgoing.data_ptr(), outgoing.numel() * int64_t(outgoing.itemsize()), dst,
                   incoming.data_ptr(), incoming.numel() * int64_t(incoming.itemsize()), src,
                   kUInt8, tag);
}

// An exchange's headers go first, grouped as the payloads are; on a mismatch the payloads still
// cross (into a buffer of the sent shape), so both channels stay in step, and this rank raises.
void exchange_checked(Group::Impl& g, Communicator* route, const Tensor& outgoing, int dst,
                      const Tensor& incoming, int src, int tag) {
  const Header mine = header_of(outgoing), expected = header_of(incoming);
  Header sent{};
  g.comm->send_recv(mine.data(), kHeaderSize, dst, sent.data(), kHeaderSize, src, kInt64, tag);
  if (sent == expected) return;
  const Tensor discard = drain_for(sent, incoming.device());
  if (discard.defined()) exchange_bytes(route, outgoing, dst, discard, src, tag);
  fail_mismatch("send_recv", src, sent, expected);
}

// An isend's header and payload in flight together; the header's bytes live here.
class PendingWithHeader final : public PendingSend {
 public:
  Header header{};
  std::unique_ptr<PendingSend> header_send, payload_send;
  bool done() override {
    if (header_send && header_send->done()) header_send.reset();
    if (payload_send && payload_send->done()) payload_send.reset();
    return !header_send && !payload_send;
  }
};

}  // namespace

Work send(const Tensor& tensor, int dst, const Group& group, int tag, bool async_op) {
  Call c(Op::Send, group);
  check_tensor(c, tensor, "tensor");
  Group::Impl& g = member(c);
  check_peer(c, g, dst);
  Tensor buffer = staged(tensor);
  count_message(runtime().sent_to, g, dst);
  return issue(
      c, fingerprint(c, 0, &tensor, dst, std::nullopt, false), false,
      [comm = g.route(buffer), g = &g, buffer, dst, tag, guarded = p2p_guarded()] {
        if (guarded) {
          const Header header = header_of(buffer);
          g->comm->send(header.data(), kHeaderSize, kInt64, dst, tag);
        }
        comm->send(buffer.data_ptr(), buffer.numel(), buffer.dtype(), dst, tag);
      },
      async_op);
}

Work recv(const Tensor& tensor, int src, const Group& group, int tag, bool async_op) {
  Call c(Op::Recv, group);
  check_tensor(c, tensor, "tensor");
  Group::Impl& g = member(c);
  check_peer(c, g, src);
  Tensor buffer = staging_for(tensor);
  count_message(runtime().received_from, g, src);
  return issue(
      c, fingerprint(c, 0, &tensor, src, std::nullopt, false), false,
      [comm = g.route(buffer), g = &g, buffer, tensor, src, tag, guarded = p2p_guarded()] {
        if (guarded) receive_checked(*g, comm, buffer, src, tag);
        comm->recv(buffer.data_ptr(), buffer.numel(), buffer.dtype(), src, tag);
        land(buffer, tensor);
      },
      async_op);
}

Work isend(const Tensor& tensor, int dst, const Group& group, int tag) {
  Call c(Op::Send, group);
  check_tensor(c, tensor, "tensor");
  Group::Impl& g = member(c);
  check_peer(c, g, dst);
  auto state = std::make_shared<Work::State>();
  state->keep_alive = staged(tensor);
  count_message(runtime().sent_to, g, dst);
  issue(
      c, fingerprint(c, 0, &tensor, dst, std::nullopt, false), false,
      [comm = g.route(state->keep_alive), g = &g, state, dst, tag, guarded = p2p_guarded()] {
        const Tensor& buffer = state->keep_alive;
        std::unique_ptr<PendingSend> pending;
        if (guarded) {
          auto both = std::make_unique<PendingWithHeader>();
          both->header = header_of(buffer);
          both->header_send =
              g->comm->start_send(both->header.data(), kHeaderSize, kInt64, dst, tag);
          both->payload_send =
              comm->start_send(buffer.data_ptr(), buffer.numel(), buffer.dtype(), dst, tag);
          if (!both->done()) pending = std::move(both);
        } else {
          pending = comm->start_send(buffer.data_ptr(), buffer.numel(), buffer.dtype(), dst, tag);
        }
        std::lock_guard lock(state->mutex);
        state->pending = std::move(pending);
        if (!state->pending) state->keep_alive = Tensor();
      },
      false);
  state->finish(nullptr);
  Work work(state);
  g.track_send(work);
  return work;
}

Work send_recv(const Tensor& to_send, int dst, const Tensor& to_receive, int src,
               const Group& group, int tag, bool async_op) {
  Call c(Op::Send, group);
  check_tensor(c, to_send, "to_send");
  check_tensor(c, to_receive, "to_receive");
  Group::Impl& g = member(c);
  check_peer(c, g, dst);
  check_peer(c, g, src);
  WEAVE_CHECK(to_send.device().type == to_receive.device().type, c.name,
              "to_send is on {} but to_receive is on {}; hint: exchange tensors of one device type",
              to_send.device(), to_receive.device());
  Tensor outgoing = staged(to_send), incoming = staging_for(to_receive);
  count_message(runtime().sent_to, g, dst);
  count_message(runtime().received_from, g, src);
  Fingerprint print = fingerprint(c, 0, &to_send, dst, std::nullopt, false);
  print.extra = src + 1;  // the watchdog's probe asks both partners (roll_call.cpp)
  return issue(
      c, print, false,
      [comm = g.route(outgoing), g = &g, outgoing, incoming, to_receive, dst, src, tag,
       guarded = p2p_guarded()] {
        if (guarded) exchange_checked(*g, comm, outgoing, dst, incoming, src, tag);
        exchange_bytes(comm, outgoing, dst, incoming, src, tag);
        land(incoming, to_receive);
      },
      async_op);
}

namespace {

// An exchange's description of one tensor: the guard's header and the sender's device type, so
// the receiver allocates what arrives (a CPU tensor stays on the CPU).
using ExchangeHeader = std::array<int64_t, kHeaderSize + 1>;

// The payloads of one exchange, grouped by the communicator that moves them (the host's, and
// NCCL's for CUDA tensors): a pair of ranks puts each tensor on the same one, since the receiver
// allocates on the sender's device type, and every rank runs the host group first.
void exchange_payloads(Group::Impl& g, const std::vector<Tensor>& outgoing,
                       const std::vector<int>& to, const std::vector<Tensor>& incoming,
                       const std::vector<int>& from, int tag) {
  for (Communicator* route : {g.comm.get(), g.device_comm.get()}) {
    if (route == nullptr) continue;
    std::vector<Communicator::Part> parts;
    auto add = [&](bool send, const Tensor& t, int peer) {
      if (g.route(t) == route)
        parts.push_back({send, t.data_ptr(), t.numel() * int64_t(t.itemsize()), peer});
    };
    for (size_t i = 0; i < outgoing.size(); ++i) add(true, outgoing[i], to[i]);
    for (size_t i = 0; i < incoming.size(); ++i) add(false, incoming[i], from[i]);
    if (!parts.empty()) route->exchange(parts, tag);
  }
}

}  // namespace

std::vector<Tensor> exchange(const std::vector<Tensor>& sends, const std::vector<int>& to,
                             const std::vector<int>& from, const Group& group, int tag) {
  Call c(Op::Send, group);
  Group::Impl& g = member(c);
  WEAVE_CHECK(sends.size() == to.size(), c.name,
              "expected one destination per tensor to send, found {} tensors and {} "
              "destinations",
              sends.size(), to.size());
  std::vector<Tensor> outgoing;
  for (size_t i = 0; i < sends.size(); ++i) {
    check_tensor(c, sends[i], "a tensor to send");
    check_peer(c, g, to[i]);
    outgoing.push_back(staged(sends[i]));
  }
  for (int src : from) check_peer(c, g, src);
  for (int dst : to) count_message(runtime().sent_to, g, dst);
  for (int src : from) count_message(runtime().received_from, g, src);
  std::vector<Tensor> received(from.size());
  if (sends.empty() && from.empty()) return received;
  issue(
      c, fingerprint(c, 0, sends.empty() ? nullptr : &sends.front(), -1, std::nullopt, false),
      false,
      [&] {
        // First what each tensor is, as one grouped exchange on the host, then the payloads:
        // the receivers learn dtypes and shapes. Pairs of ranks meet in both, in that order.
        std::vector<ExchangeHeader> described(outgoing.size()), arriving(from.size());
        std::vector<Communicator::Part> parts;
        for (size_t i = 0; i < outgoing.size(); ++i) {
          std::copy_n(header_of(outgoing[i]).begin(), kHeaderSize, described[i].begin());
          described[i][kHeaderSize] = static_cast<int64_t>(sends[i].device().type);
          parts.push_back({true, described[i].data(), int64_t(sizeof(ExchangeHeader)), to[i]});
        }
        for (size_t i = 0; i < from.size(); ++i)
          parts.push_back({false, arriving[i].data(), int64_t(sizeof(ExchangeHeader)), from[i]});
        g.comm->exchange(parts, tag);
        std::vector<Tensor> incoming(from.size());
        for (size_t i = 0; i < from.size(); ++i) {
          Header sent{};
          std::copy_n(arriving[i].begin(), kHeaderSize, sent.begin());
          const auto type = static_cast<DeviceType>(arriving[i][kHeaderSize]);
          received[i] = drain_for(sent, receiving_device(type, "exchange"));
          WEAVE_CHECK(received[i].defined(), "exchange",
                      "group rank {} sent an unreadable description of its tensor; hint: every "
                      "send and receive of an exchange pairs with one of the peer's exchange",
                      from[i]);
          incoming[i] = staging_for(received[i]);
        }
        exchange_payloads(g, outgoing, to, incoming, from, tag);
        for (size_t i = 0; i < from.size(); ++i) land(incoming[i], received[i]);
      },
      false);
  return received;
}

void wait_sends(const Group& group) {
  Call c(Op::Send, group);
  member(c).wait_sends();
}

}  // namespace weave::dist
