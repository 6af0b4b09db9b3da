// megarl._suffix_index: bounded-depth suffix trie with counts, the lookup structure of the
// speculative-decoding draft sources (history, group and bubble sources in megarl/spec).
//
// The Python twin `megarl/spec/suffix_index.py::PySuffixIndex` implements the same algorithm step
// for step (only the edge table differs: a dict per node there) and must give identical results;
// tests/spec/test_suffix_index.py checks parity.
// Read the twin's docstrings for the semantics; comments here explain the C++ specifics.
//
// Layout: nodes live in one flat array indexed by int32 id (0 = root). Edges (parent, token) -> child
// live in one open-addressing table (linear probing, power-of-two capacity, no erase), so the root
// can carry a full LLM vocabulary while deep nodes cost no per-node container. An edge's slot is
// found from the hash of the child's whole path, not of (parent, token): walking down the trie,
// every slot address follows from the tokens alone, so the CPU overlaps the cache misses of all
// levels instead of paying them one after another (lookups are memory-latency bound). Slots still
// hold (parent, token), so lookups are exact whatever the hash collisions.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace {

constexpr int64_t kMaxToken = 2147483647;  // token ids are stored as int32

// Python's operator.index(h) as int64 in [lo, hi]; TypeError for non-ints, ValueError out of range.
// `ok` (when given) turns the range check into a flag instead of an exception.
int64_t to_int(py::handle h, int64_t lo, int64_t hi, const std::string& what, bool* ok = nullptr) {
  PyObject* idx = PyLong_CheckExact(h.ptr()) ? (Py_INCREF(h.ptr()), h.ptr()) : PyNumber_Index(h.ptr());
  if (idx == nullptr) throw py::error_already_set();
  int overflow = 0;
  long long v = PyLong_AsLongLongAndOverflow(idx, &overflow);
  Py_DECREF(idx);
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  bool in_range = overflow == 0 && v >= lo && v <= hi;
  if (ok != nullptr) {
    *ok = in_range;
    return in_range ? v : -1;
  }
  if (!in_range)
    throw py::value_error(what + " must be an int in [" + std::to_string(lo) + ", " +
                          std::to_string(hi) + "], got " + py::repr(h).cast<std::string>());
  return v;
}

// Hash of a node's path (its string from the root), from its parent's: splitmix64's finalizer.
inline uint64_t path_hash(uint64_t parent_hash, int64_t token) {
  uint64_t h = parent_hash + 0x9e3779b97f4a7c15ULL * uint64_t(token + 1);
  h ^= h >> 30; h *= 0xbf58476d1ce4e5b9ULL;
  h ^= h >> 27; h *= 0x94d049bb133111ebULL;
  return h ^ (h >> 31);
}

class SuffixIndex {
 public:
  explicit SuffixIndex(int64_t max_depth) {
    if (max_depth < 2) throw py::value_error("max_depth must be an int >= 2, got " + std::to_string(max_depth));
    max_depth_ = max_depth;
    new_node(-1, 0);  // root; its path hash is 0
  }

  void add(py::handle seq_id_obj, py::iterable tokens_obj) {
    int64_t seq_id = to_int(seq_id_obj, 0, INT64_MAX, "seq_id");
    std::vector<int32_t> tokens;  // validate everything before mutating: add() is all-or-nothing
    for (py::handle t : tokens_obj) tokens.push_back(int32_t(to_int(t, 0, kMaxToken, "token id")));
    auto it = seqs_.find(seq_id);  // each token adds at most min(max_depth, suffix length) nodes
    int64_t len = int64_t((it == seqs_.end() ? 1 : it->second.size()) + tokens.size());
    if (double(nodes_.size()) + double(tokens.size()) * double(std::min(max_depth_, len)) > double(INT32_MAX))
      throw std::length_error("suffix index is full (node ids are int32)");
    std::vector<int32_t>& active = seqs_[seq_id];
    if (active.empty()) active.push_back(0);
    for (int32_t t : tokens) append(active, t);
  }

  py::tuple draft(py::object context, int64_t max_tokens, int64_t max_match, int64_t min_match,
                  double min_prob) const {
    if (max_tokens < 0) throw py::value_error("max_tokens must be an int >= 0, got " + std::to_string(max_tokens));
    if (min_match < 1) throw py::value_error("min_match must be an int >= 1, got " + std::to_string(min_match));
    if (max_match < min_match)
      throw py::value_error("max_match must be an int >= min_match (" + std::to_string(min_match) + "), got " +
                            std::to_string(max_match));
    if (!(min_prob >= 0.0 && min_prob <= 1.0))  // also rejects NaN
      throw py::value_error("min_prob must be a float in [0, 1], got " +
                            py::repr(py::float_(min_prob)).cast<std::string>());
    // Only the last L context tokens can matter; read just those (contexts can be long).
    int64_t n = int64_t(py::len(context));
    int64_t L = std::min<int64_t>({max_match, n, max_depth_ - 1});
    py::list out;
    if (L < min_match) return py::make_tuple(out, 0);
    int64_t buf[64];  // the tail, on the stack when it fits; -1: not a token id, matches nothing
    std::vector<int64_t> heap(L > 64 ? L : 0);
    int64_t* tail = L > 64 ? heap.data() : buf;
    // Lists and tuples: borrowed items. Anything else with len() and [] (tensors, arrays): __getitem__.
    bool fast = PyList_Check(context.ptr()) || PyTuple_Check(context.ptr());
    for (int64_t i = 0; i < L; ++i) {
      bool ok;
      if (fast && PySequence_Fast_GET_SIZE(context.ptr()) != n)  // an item's __index__ resized it
        throw std::runtime_error("context changed size during draft()");
      py::object item = fast ? py::reinterpret_borrow<py::object>(PySequence_Fast_GET_ITEM(context.ptr(), n - L + i))
                             : py::object(context[py::int_(n - L + i)]);
      int64_t v = to_int(item, 0, kMaxToken, "", &ok);
      tail[i] = ok ? v : -1;
    }
    // "context[-m:] is a path with a child" is downward closed in m: every substring of an indexed
    // sequence of length <= max_depth is indexed, so if s + c is, so is (suffix of s) + c. Hence
    // the longest such m is found by binary search; the twin does the same search.
    int64_t m = 0;
    int32_t node = -1;
    int64_t lo = min_match, hi = L;
    int32_t v = walk(tail, L, L);  // fast path: the full tail usually matches in repetitive text
    if (v >= 0 && nodes_[v].best >= 0) {
      m = L; node = v; lo = L + 1;
    } else {
      hi = L - 1;
    }
    while (lo <= hi) {
      int64_t mid = lo + (hi - lo) / 2;
      v = walk(tail, L, mid);
      if (v >= 0 && nodes_[v].best >= 0) {
        m = mid; node = v; lo = mid + 1;
      } else {
        hi = mid - 1;
      }
    }
    if (m == 0) return py::make_tuple(out, 0);
    // Greedy extension along the most frequent (then most recent) child, maintained in Node::best.
    int64_t steps = std::min<int64_t>(max_tokens, max_depth_ - m);
    double prob = 1.0;
    for (int64_t i = 0; i < steps; ++i) {
      int32_t c = nodes_[node].best;
      if (c < 0) break;
      prob *= double(nodes_[c].count) / double(nodes_[node].count);
      if (prob < min_prob) break;
      out.append(nodes_[c].token);
      node = c;
    }
    return py::make_tuple(out, m);
  }

  py::tuple node_stats(py::iterable path) const {
    int32_t node = 0;
    uint64_t h = 0;
    for (py::handle item : path) {
      bool ok;
      int64_t t = to_int(item, 0, kMaxToken, "", &ok);
      h = path_hash(h, t);
      node = ok ? child(h, node, t) : -1;
      if (node < 0) return py::make_tuple(0, 0);
    }
    return py::make_tuple(nodes_[node].count, nodes_[node].last);
  }

  int64_t max_depth() const { return max_depth_; }
  int64_t n_sequences() const { return int64_t(seqs_.size()); }
  int64_t n_tokens() const { return clock_; }
  int64_t n_nodes() const { return int64_t(nodes_.size()) - 1; }  // root excluded

 private:
  struct Node {  // one struct per node: a draft step touches one cache line
    int64_t count, last;
    int32_t best, token;  // best: the greedy child (largest count, then most recent), or -1
  };
  struct Slot {  // an edge; parent -1 marks an empty slot
    int32_t parent = -1, token = -1, child = -1;
  };

  int32_t new_node(int64_t token, uint64_t hash) {
    nodes_.push_back({0, 0, -1, int32_t(token)});
    hash_.push_back(hash);
    return int32_t(nodes_.size() - 1);
  }

  int32_t child(uint64_t h, int32_t parent, int64_t token) const {  // h: the child's path hash; -1 if absent
    for (size_t i = h & (slots_.size() - 1);; i = (i + 1) & (slots_.size() - 1)) {
      const Slot& s = slots_[i];
      if (s.parent == parent && s.token == token) return s.child;
      if (s.parent < 0) return -1;
    }
  }

  void add_edge(const Slot& e) {  // e must be absent
    if (2 * (n_edges_ + 1) > slots_.size()) {
      std::vector<Slot> old(slots_.size() * 2);
      old.swap(slots_);
      n_edges_ = 0;
      for (const Slot& s : old)
        if (s.parent >= 0) add_edge(s);
    }
    size_t i = hash_[e.child] & (slots_.size() - 1);
    while (slots_[i].parent >= 0) i = (i + 1) & (slots_.size() - 1);
    slots_[i] = e;
    ++n_edges_;
  }

  // active[k] is the node of the sequence's suffix of length k (k < max_depth); active[0] = root.
  // Walk deepest first so active[k + 1] is overwritten only after it has been extended itself.
  void append(std::vector<int32_t>& active, int32_t t) {
    ++clock_;
    ++nodes_[0].count;
    nodes_[0].last = clock_;
    for (int64_t k = int64_t(active.size()) - 1; k >= 0; --k) {
      int32_t parent = active[k];
      uint64_t h = path_hash(hash_[parent], t);
      int32_t c = child(h, parent, t);
      if (c < 0) {
        c = new_node(t, h);
        add_edge({parent, t, c});
      }
      ++nodes_[c].count;
      nodes_[c].last = clock_;
      // Only c's key (count, last) grew, and c is now the most recent sibling, so it becomes the
      // best child iff its count reaches the best one's (siblings never share a `last`).
      int32_t b = nodes_[parent].best;
      if (b != c && (b < 0 || nodes_[c].count >= nodes_[b].count)) nodes_[parent].best = c;
      if (k + 1 < max_depth_) {
        if (k + 1 == int64_t(active.size())) active.push_back(c);
        else active[k + 1] = c;
      }
    }
  }

  int32_t walk(const int64_t* tail, int64_t L, int64_t m) const {  // node of tail[L-m:L], or -1
    uint64_t h = 0;  // the root's path hash
    for (int64_t i = L - m; i < L; ++i) {  // first touch every level's slot, then walk
      if (tail[i] < 0) return -1;
      h = path_hash(h, tail[i]);
      __builtin_prefetch(&slots_[h & (slots_.size() - 1)]);
    }
    int32_t node = 0;
    h = 0;
    for (int64_t i = L - m; i < L && node >= 0; ++i) {
      h = path_hash(h, tail[i]);
      node = child(h, node, tail[i]);
    }
    return node;
  }

  int64_t max_depth_;
  int64_t clock_ = 0;
  std::vector<Node> nodes_;
  std::vector<uint64_t> hash_;  // path hash per node (cold: used by add() only)
  std::vector<Slot> slots_ = std::vector<Slot>(1024);
  size_t n_edges_ = 0;
  std::unordered_map<int64_t, std::vector<int32_t>> seqs_;
};

}  // namespace

PYBIND11_MODULE(_suffix_index, m) {
  m.doc() = "C++ suffix index for speculative drafts; semantics in megarl/spec/suffix_index.py";
  py::class_<SuffixIndex>(m, "SuffixIndex")
      .def(py::init<int64_t>(), py::arg("max_depth") = 24)
      .def("add", &SuffixIndex::add, py::arg("seq_id"), py::arg("tokens"))
      .def("draft", &SuffixIndex::draft, py::arg("context"), py::arg("max_tokens"), py::arg("max_match") = 16,
           py::arg("min_match") = 1, py::arg("min_prob") = 0.0)
      .def("node_stats", &SuffixIndex::node_stats, py::arg("path"))
      .def_property_readonly("max_depth", &SuffixIndex::max_depth)
      .def_property_readonly("n_sequences", &SuffixIndex::n_sequences)
      .def_property_readonly("n_tokens", &SuffixIndex::n_tokens)
      .def_property_readonly("n_nodes", &SuffixIndex::n_nodes)
      .def("__repr__", [](const SuffixIndex& s) {
        return "SuffixIndex(max_depth=" + std::to_string(s.max_depth()) + ", n_sequences=" +
               std::to_string(s.n_sequences()) + ", n_tokens=" + std::to_string(s.n_tokens()) +
               ", n_nodes=" + std::to_string(s.n_nodes()) + ")";
      });
}
