// Suffix decoding's token store and draft tree (the Python reference: specserve.drafters.suffix's
// `TokenStore` and `draft_nodes`), with the same results, tie-breaks included.
//
// TokenStore: token segments at absolute positions, position p at buf[p % capacity], live positions
// [low, high); per salt (any hashable Python object, None included) each k-gram of a segment -> the
// positions that follow it, increasing. A ring store evicts its oldest closed segments; evicted
// positions leave the index lazily (on lookup) and in one sweep per capacity of evicted writes.
//
// propose: one request's step in one call, its own store and the shared one searched and the better
// scored tree kept, laid out as DraftTree.from_parents lays it out. Nothing here releases the GIL or
// starts threads: every call is short.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

constexpr int32_t SENTINEL = -1;            // ends a segment; never a token id
constexpr int64_t MAX_CANDIDATES = 256;     // the most recent positions after a k-gram that one lookup weighs
constexpr int TOKEN_BITS = 24;              // a token id fits in 3 bytes of a k-gram's key
constexpr int64_t TOKEN_LIMIT = int64_t{1} << TOKEN_BITS;

using Positions = std::vector<int64_t>;
using Keys = std::unordered_map<std::string, Positions>;  // k-gram (3 bytes per token, big-endian) -> positions

struct Salt {
  py::object salt;
  Keys keys;
};

// a list's or tuple's ints, or any array-like's (as int64), into `out`
void read_tokens(py::handle obj, std::vector<int64_t>& out) {
  out.clear();
  PyObject* p = obj.ptr();
  if (PyList_Check(p) || PyTuple_Check(p)) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(p);
    PyObject** items = PySequence_Fast_ITEMS(p);
    out.resize(n);
    for (Py_ssize_t i = 0; i < n; ++i) {
      long long v = PyLong_AsLongLong(items[i]);
      if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
      out[i] = v;
    }
    return;
  }
  auto arr = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(obj);
  if (!arr) throw py::type_error("token store: tokens must be a sequence of ints or an integer array");
  if (arr.ndim() != 1) throw py::value_error("token store: tokens must be one-dimensional");
  out.assign(arr.data(), arr.data() + arr.size());
}

template <class T>
void put_key(std::string& key, size_t at, T t) {
  key[at] = static_cast<char>((t >> 16) & 0xff);
  key[at + 1] = static_cast<char>((t >> 8) & 0xff);
  key[at + 2] = static_cast<char>(t & 0xff);
}

class TokenStore {
 public:
  TokenStore(int64_t capacity, int64_t k, bool ring) : k_(k), ring_(ring) {
    if (capacity < 2 || k < 1) throw py::value_error("token store: capacity must be >= 2 and k >= 1");
    buf_.assign(capacity, SENTINEL);
    recent_.assign(k, 0);
    key_.assign(3 * k, '\0');
  }

  int64_t capacity() const { return static_cast<int64_t>(buf_.size()); }
  int64_t num_tokens() const { return high_ - low_; }

  // buf index of position p (floor modulo, as numpy's)
  int64_t slot(int64_t p) const {
    int64_t c = capacity(), i = p % c;
    return i < 0 ? i + c : i;
  }

  int64_t last() const { return buf_[slot(high_ - 1)]; }

  void append(const int64_t* t, int64_t n, py::handle salt) {
    if (n == 0) return;
    for (int64_t i = 0; i < n; ++i)
      if (t[i] < 0 || t[i] >= TOKEN_LIMIT)
        throw py::value_error("token store: token ids must be in [0, " + std::to_string(TOKEN_LIMIT) + ")");
    if (!open_) {
      starts_.push_back(high_);
      open_ = true;
      run_ = 0;
    }
    if (ring_ && n >= capacity()) {  // only the last ones fit, with nothing before them
      t += n - (capacity() - 1);
      n = capacity() - 1;
      run_ = 0;
    }
    make_room(n);
    Keys& keys = find(salt, true)->keys;
    int64_t cap = capacity(), i = slot(high_);
    for (int64_t j = 0; j < n; ++j) {
      buf_[i] = static_cast<int32_t>(t[j]);
      if (++i == cap) i = 0;
      if (run_ >= k_) {  // k tokens precede this position in its segment: it follows their k-gram
        for (int64_t q = 0; q < k_; ++q) put_key(key_, 3 * q, recent_[(run_ - k_ + q) % k_]);
        keys[key_].push_back(high_ + j);
      }
      recent_[run_ % k_] = static_cast<int32_t>(t[j]);
      ++run_;
    }
    high_ += n;
  }

  void close() {
    if (open_) {
      make_room(1);
      buf_[slot(high_)] = SENTINEL;
      ++high_;
      open_ = false;
    }
  }

  // (match length, into `out` the positions whose preceding tokens equal the longest suffix of the
  // context found, k <= length <= max_len); 0 when its last k tokens are unseen
  template <class T>
  int64_t match(const T* ctx, int64_t len, int64_t max_len, py::handle salt, std::vector<int64_t>& out) {
    out.clear();
    if (len < k_) return 0;
    for (int64_t q = 0; q < k_; ++q) {
      int64_t t = ctx[len - k_ + q];
      if (t < 0 || t >= TOKEN_LIMIT) return 0;  // no k-gram of token ids
      put_key(key_, 3 * q, t);
    }
    Salt* s = find(salt, false);
    if (s == nullptr) return 0;
    auto it = s->keys.find(key_);
    if (it == s->keys.end()) return 0;
    Positions& pos = it->second;
    if (pos.front() < low_) {  // evicted positions go lazily
      pos.erase(pos.begin(), std::lower_bound(pos.begin(), pos.end(), low_));
      if (pos.empty()) {
        s->keys.erase(it);
        return 0;
      }
    }
    auto from = pos.end() - std::min<int64_t>(MAX_CANDIDATES, static_cast<int64_t>(pos.size()));
    int64_t n = std::min(max_len, len);
    if (n <= k_) {
      out.assign(from, pos.end());
      return k_;
    }
    // each candidate's tokens before it against the context's last ones: the match length is the
    // run of equal tokens (the first k equal by the key)
    int64_t cap = capacity(), limit = n - k_, best = 0;
    runs_.clear();
    for (auto c = from; c != pos.end(); ++c) {
      int64_t p = *c - k_ - 1, m = 0;
      if (p >= low_) {
        int64_t i = slot(p);
        const T* want = ctx + len - k_ - 1;
        while (m < limit && p >= low_ && static_cast<int64_t>(buf_[i]) == static_cast<int64_t>(want[-m])) {
          ++m;
          --p;
          i = i ? i - 1 : cap - 1;
        }
      }
      runs_.push_back(m);
      best = std::max(best, m);
    }
    for (size_t r = 0; r < runs_.size(); ++r)
      if (runs_[r] == best) out.push_back(from[r]);
    return k_ + best;
  }

  // (m, depth) rows into `out`: the tokens from each position on, SENTINEL from the end of its
  // segment (or of what is written) on
  void continuations(const int64_t* at, int64_t m, int64_t depth, int32_t* out) const {
    int64_t cap = capacity();
    for (int64_t r = 0; r < m; ++r) {
      int64_t p = at[r], i = slot(p);
      int32_t* row = out + r * depth;
      bool ended = false;
      for (int64_t j = 0; j < depth; ++j) {
        int32_t v = SENTINEL;
        if (!ended && p + j < high_) {
          v = buf_[i];
          if (++i == cap) i = 0;
        }
        ended = ended || v == SENTINEL;
        row[j] = ended ? SENTINEL : v;
      }
    }
  }

  // the live tokens [low, high) in position order, into `out`
  void tokens(std::vector<int32_t>& out) const {
    out.resize(num_tokens());
    for (int64_t p = low_; p < high_; ++p) out[p - low_] = buf_[slot(p)];
  }

  // the index as the Python store holds it: salt -> k-gram key -> positions
  py::dict index() const {
    py::dict result;
    py::object from_bytes = py::module_::import("builtins").attr("int").attr("from_bytes");
    for (const auto& s : salts_) {
      if (!s) continue;
      py::dict keys;
      for (const auto& [key, pos] : s->keys) {
        py::list positions;
        for (int64_t p : pos) positions.append(p);
        keys[from_bytes(py::bytes(key), "big")] = positions;
      }
      result[s->salt] = keys;
    }
    return result;
  }

  int64_t index_size() const {
    int64_t n = 0;
    for (const auto& s : salts_)
      if (s)
        for (const auto& kv : s->keys) n += static_cast<int64_t>(kv.second.size());
    return n;
  }

  int64_t k_;
  bool ring_;
  std::vector<int32_t> buf_;
  int64_t low_ = 0, high_ = 0;

 private:
  Salt* find(py::handle salt, bool create) {
    PyObject* id = PyDict_GetItemWithError(ids_.ptr(), salt.ptr());
    if (id != nullptr) return salts_[PyLong_AsSsize_t(id)].get();
    if (PyErr_Occurred()) throw py::error_already_set();
    if (!create) return nullptr;
    size_t n;
    if (free_.empty()) {
      n = salts_.size();
      salts_.emplace_back();
    } else {
      n = free_.back();
      free_.pop_back();
    }
    salts_[n] = std::make_unique<Salt>();
    salts_[n]->salt = py::reinterpret_borrow<py::object>(salt);
    ids_[salt] = py::int_(n);
    return salts_[n].get();
  }

  void make_room(int64_t n) {
    if (high_ + n - low_ <= capacity()) return;
    if (!ring_) {  // grow: positions equal indices, nothing wraps
      buf_.resize(std::max(2 * capacity(), high_ + n), SENTINEL);
      return;
    }
    int64_t low = high_ + n - capacity();
    while (starts_.size() > 1 && starts_.front() < low) {
      starts_.pop_front();
      low_ = starts_.front();
    }
    if (low_ < low) low_ = low;  // the open segment alone is too long: its oldest tokens go
    evicted_ += n;
    if (evicted_ > capacity()) sweep();  // one sweep per capacity of writes: the index stays bounded
  }

  void sweep() {
    evicted_ = 0;
    for (size_t n = 0; n < salts_.size(); ++n) {
      if (!salts_[n]) continue;
      Keys& keys = salts_[n]->keys;
      for (auto it = keys.begin(); it != keys.end();) {
        Positions& pos = it->second;
        if (pos.back() < low_) {
          it = keys.erase(it);
          continue;
        }
        if (pos.front() < low_) pos.erase(pos.begin(), std::lower_bound(pos.begin(), pos.end(), low_));
        ++it;
      }
      if (keys.empty()) {
        if (PyDict_DelItem(ids_.ptr(), salts_[n]->salt.ptr()) != 0) throw py::error_already_set();
        salts_[n].reset();
        free_.push_back(n);
      }
    }
  }

  std::deque<int64_t> starts_;   // each segment's first position, oldest first
  bool open_ = false;            // the newest segment is still being appended to
  int64_t run_ = 0;              // tokens of the open segment written so far
  std::vector<int32_t> recent_;  // its last k tokens, at run % k
  int64_t evicted_ = 0;          // positions evicted since the last sweep
  py::dict ids_;                 // salt -> its index in salts_
  std::vector<std::unique_ptr<Salt>> salts_;
  std::vector<size_t> free_;
  std::string key_;              // scratch k-gram key
  std::vector<int64_t> runs_;    // scratch match lengths
};

struct Tree {
  std::vector<int64_t> tokens, parents;
  std::vector<double> shares;  // per node, the share of the rows through it (the root's 1)
  double score = 0.0;
};

// The draft tree of `rows` (nrows x ncols, row stride `stride`, oldest candidate first): every node of
// the rows' trie that at least min_token_prob of the rows pass through, at most
// max_spec_factor x match_len deep, ranked by (count desc, level asc, newest row through it), the
// first num_draft_tokens - 1 kept below the root. Built from the distinct rows sorted, each trie
// node being a run of sorted rows that share its prefix.
Tree draft_nodes(int64_t root, const int32_t* rows, int64_t nrows, int64_t ncols, int64_t stride,
                 int64_t match_len, int64_t num_draft_tokens, double min_token_prob, double max_spec_factor) {
  Tree tree;
  tree.tokens.push_back(root);
  tree.parents.push_back(-1);
  tree.shares.push_back(1.0);
  double limit = max_spec_factor * static_cast<double>(match_len);
  int64_t depth = limit >= static_cast<double>(ncols) ? ncols : static_cast<int64_t>(limit);
  if (depth < 1 || num_draft_tokens < 2 || nrows == 0) return tree;

  // distinct rows (up to their first SENTINEL), newest first: rank = newest-first index of a row
  struct Path {
    const int32_t* row;
    int64_t len, weight, first;
    uint64_t hash;
  };
  std::vector<Path> paths;
  size_t table_size = 16;
  while (table_size < 2 * static_cast<size_t>(nrows)) table_size *= 2;
  std::vector<int32_t> table(table_size, -1);
  for (int64_t rank = 0; rank < nrows; ++rank) {
    const int32_t* row = rows + (nrows - 1 - rank) * stride;
    int64_t len = 0;
    uint64_t h = 0x9e3779b97f4a7c15ull;
    while (len < depth && row[len] != SENTINEL) {
      h = (h ^ static_cast<uint32_t>(row[len])) * 0x100000001b3ull;
      h ^= h >> 29;
      ++len;
    }
    if (len == 0) continue;  // a row that ends at once passes through no node
    size_t at = (h ^ static_cast<uint64_t>(len)) & (table_size - 1);
    for (;; at = (at + 1) & (table_size - 1)) {
      int32_t p = table[at];
      if (p < 0) {
        table[at] = static_cast<int32_t>(paths.size());
        paths.push_back({row, len, 1, rank, h});
        break;
      }
      Path& q = paths[p];
      if (q.hash == h && q.len == len && std::memcmp(q.row, row, len * sizeof(int32_t)) == 0) {
        ++q.weight;
        break;
      }
    }
  }
  std::sort(paths.begin(), paths.end(), [](const Path& a, const Path& b) {
    return std::lexicographical_compare(a.row, a.row + a.len, b.row, b.row + b.len);
  });

  // trie nodes: per level the open node of the current row's prefix
  struct Node {
    int64_t token, parent, level, count, first;
  };
  std::vector<Node> nodes;
  std::vector<int64_t> open;  // node id per level
  const Path* prev = nullptr;
  for (const Path& path : paths) {
    int64_t lcp = 0;
    if (prev != nullptr)
      while (lcp < prev->len && lcp < path.len && prev->row[lcp] == path.row[lcp]) ++lcp;
    open.resize(lcp);
    for (int64_t level = lcp; level < path.len; ++level) {
      open.push_back(static_cast<int64_t>(nodes.size()));
      nodes.push_back({path.row[level], level ? open[level - 1] : -1, level, 0, path.first});
    }
    for (int64_t level = 0; level < path.len; ++level) {
      Node& node = nodes[open[level]];
      node.count += path.weight;
      node.first = std::min(node.first, path.first);
    }
    prev = &path;
  }

  double min_count = min_token_prob * static_cast<double>(nrows);
  std::vector<int64_t> kept;
  for (size_t n = 0; n < nodes.size(); ++n)
    if (static_cast<double>(nodes[n].count) >= min_count) kept.push_back(static_cast<int64_t>(n));
  auto before = [&nodes](int64_t a, int64_t b) {
    const Node &x = nodes[a], &y = nodes[b];
    if (x.count != y.count) return x.count > y.count;
    if (x.level != y.level) return x.level < y.level;
    return x.first < y.first;
  };
  // a parent comes before its children: its count is at least theirs and it is shallower
  auto keep = std::min<int64_t>(num_draft_tokens - 1, static_cast<int64_t>(kept.size()));
  std::partial_sort(kept.begin(), kept.begin() + keep, kept.end(), before);
  std::vector<int64_t> index(nodes.size(), -1);
  int64_t total = 0;
  for (int64_t i = 0; i < keep; ++i) {
    const Node& node = nodes[kept[i]];
    index[kept[i]] = i + 1;
    tree.tokens.push_back(node.token);
    tree.parents.push_back(node.parent < 0 ? 0 : index[node.parent]);
    tree.shares.push_back(static_cast<double>(node.count) / static_cast<double>(nrows));
    total += node.count;
  }
  tree.score = static_cast<double>(total) / static_cast<double>(nrows);
  return tree;
}

py::tuple as_tuple(const Tree& tree) {
  py::list tokens(tree.tokens.size()), parents(tree.parents.size());
  for (size_t i = 0; i < tree.tokens.size(); ++i) {
    tokens[i] = py::int_(tree.tokens[i]);
    parents[i] = py::int_(tree.parents[i]);
  }
  return py::make_tuple(tokens, parents, tree.score);
}

// a tree as DraftTree.from_parents lays it out: links (5, n) int64 (tokens, parents, depth, first_child,
// next_sibling; -1 = none) and mask (n, n) bool, mask[i, j] iff j is i or an ancestor of i; then its score
// and its nodes' shares (n,) float64
py::tuple tree_arrays(const Tree& tree) {
  auto n = static_cast<py::ssize_t>(tree.tokens.size());
  py::array_t<int64_t> links({py::ssize_t{5}, n});
  py::array_t<bool> mask({n, n});
  int64_t* tokens = links.mutable_data();
  int64_t *parents = tokens + n, *depth = parents + n, *first_child = depth + n, *next_sibling = first_child + n;
  bool* m = mask.mutable_data();
  std::memset(m, 0, static_cast<size_t>(n * n));
  std::vector<int64_t> last_child(n, -1);
  for (py::ssize_t i = 0; i < n; ++i) {
    tokens[i] = tree.tokens[i];
    parents[i] = tree.parents[i];
    first_child[i] = next_sibling[i] = -1;
    depth[i] = 0;
    int64_t p = tree.parents[i];
    if (i > 0) {
      depth[i] = depth[p] + 1;
      (last_child[p] < 0 ? first_child[p] : next_sibling[last_child[p]]) = i;
      last_child[p] = i;
      std::memcpy(m + i * n, m + p * n, static_cast<size_t>(i));
    }
    m[i * n + i] = true;
  }
  py::array_t<double> shares(n);
  std::memcpy(shares.mutable_data(), tree.shares.data(), static_cast<size_t>(n) * sizeof(double));
  return py::make_tuple(links, mask, tree.score, shares);
}

template <class T>
py::array_t<T> as_array(const std::vector<T>& v) {
  py::array_t<T> out(static_cast<py::ssize_t>(v.size()));
  if (!v.empty()) std::memcpy(out.mutable_data(), v.data(), v.size() * sizeof(T));
  return out;
}

// One request's drafting step (SuffixDrafter.propose_ranked's tree): its own store (salt None) and
// the shared store (its salt) matched against the own store's tokens, the better scored tree kept, as
// `tree_arrays`: links, mask, score and each node's share.
py::tuple propose(TokenStore& own, TokenStore& shared, py::handle salt, int64_t max_depth, int64_t num_draft_tokens,
                  double min_token_prob, double max_spec_factor) {
  thread_local std::vector<int32_t> copy, rows;
  thread_local std::vector<int64_t> at;
  const int32_t* context = own.buf_.data();
  int64_t len = own.high_;
  if (own.ring_ || own.low_ != 0) {
    own.tokens(copy);
    context = copy.data();
    len = static_cast<int64_t>(copy.size());
  }
  int64_t root = own.last();
  int64_t depth = std::min(max_depth, num_draft_tokens - 1);
  Tree best;
  best.tokens.push_back(root);
  best.parents.push_back(-1);
  best.shares.push_back(1.0);
  if (depth >= 1) {
    py::handle none(Py_None);
    for (int which = 0; which < 2; ++which) {
      TokenStore& store = which ? shared : own;
      int64_t length = store.match(context, len, max_depth, which ? salt : none, at);
      if (!length) continue;
      int64_t m = static_cast<int64_t>(at.size());
      rows.resize(m * depth);
      store.continuations(at.data(), m, depth, rows.data());
      Tree tree = draft_nodes(root, rows.data(), m, depth, depth, length, num_draft_tokens, min_token_prob,
                              max_spec_factor);
      if (tree.score > best.score) best = std::move(tree);
    }
  }
  return tree_arrays(best);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Suffix decoding's token store and draft tree (specserve.drafters.suffix's, in C++).";
  m.attr("SENTINEL") = SENTINEL;
  m.attr("MAX_CANDIDATES") = MAX_CANDIDATES;

  py::class_<TokenStore>(m, "TokenStore")
      .def(py::init<int64_t, int64_t, bool>(), py::arg("capacity"), py::arg("k"), py::arg("ring"))
      .def_property_readonly("capacity", &TokenStore::capacity)
      .def_property_readonly("num_tokens", &TokenStore::num_tokens)
      .def_property_readonly("high", [](const TokenStore& s) { return s.high_; })
      .def_property_readonly("low", [](const TokenStore& s) { return s.low_; })
      .def_property_readonly("k", [](const TokenStore& s) { return s.k_; })
      .def_property_readonly("ring", [](const TokenStore& s) { return s.ring_; })
      .def_property_readonly("index", &TokenStore::index, "salt -> k-gram key -> positions, as the Python store's")
      .def("index_size", &TokenStore::index_size, "positions in the index, all salts together")
      .def(
          "append",
          [](TokenStore& s, py::handle tokens, py::handle salt) {
            thread_local std::vector<int64_t> t;
            read_tokens(tokens, t);
            s.append(t.data(), static_cast<int64_t>(t.size()), salt);
          },
          py::arg("tokens"), py::arg("salt") = py::none())
      .def("close", &TokenStore::close)
      .def(
          "match",
          [](TokenStore& s, py::handle context, int64_t max_len, py::handle salt) {
            thread_local std::vector<int64_t> ctx, at;
            read_tokens(context, ctx);
            int64_t length = s.match(ctx.data(), static_cast<int64_t>(ctx.size()), max_len, salt, at);
            return py::make_tuple(length, as_array(at));
          },
          py::arg("context"), py::arg("max_len"), py::arg("salt") = py::none())
      .def(
          "match_store",
          [](TokenStore& s, TokenStore& other, int64_t max_len, py::handle salt) {
            thread_local std::vector<int64_t> at;
            thread_local std::vector<int32_t> copy;
            const int32_t* context = other.buf_.data();
            int64_t len = other.high_;
            if (other.ring_ || other.low_ != 0) {  // its live tokens wrap or start later: in order first
              other.tokens(copy);
              context = copy.data();
              len = static_cast<int64_t>(copy.size());
            }
            int64_t length = s.match(context, len, max_len, salt, at);
            return py::make_tuple(length, as_array(at));
          },
          py::arg("other"), py::arg("max_len"), py::arg("salt") = py::none(),
          "match with `other`'s live tokens as the context")
      .def(
          "continuations",
          [](const TokenStore& s, py::array_t<int64_t, py::array::c_style | py::array::forcecast> at, int64_t depth) {
            if (at.ndim() != 1) throw py::value_error("token store: positions must be one-dimensional");
            if (depth < 0) throw py::value_error("token store: depth must be >= 0");
            py::array_t<int32_t> rows({at.shape(0), static_cast<py::ssize_t>(depth)});
            s.continuations(at.data(), at.shape(0), depth, rows.mutable_data());
            return rows;
          },
          py::arg("positions"), py::arg("depth"))
      .def(
          "tokens",
          [](const TokenStore& s) {
            std::vector<int32_t> out;
            s.tokens(out);
            return as_array(out);
          },
          "the live tokens, positions [low, high), as int32")
      .def("last", &TokenStore::last, "the token at position high - 1");

  m.def(
      "draft_nodes",
      [](int64_t root, py::array_t<int32_t, py::array::c_style | py::array::forcecast> rows, int64_t match_len,
         int64_t num_draft_tokens, double min_token_prob, double max_spec_factor) {
        if (rows.ndim() != 2) throw py::value_error("draft_nodes: rows must be two-dimensional");
        return as_tuple(draft_nodes(root, rows.data(), rows.shape(0), rows.shape(1), rows.shape(1), match_len,
                                    num_draft_tokens, min_token_prob, max_spec_factor));
      },
      py::arg("root"), py::arg("rows"), py::arg("match_len"), py::arg("num_draft_tokens"),
      py::arg("min_token_prob"), py::arg("max_spec_factor"));
  m.def("propose", &propose, py::arg("own"), py::arg("shared"), py::arg("salt"), py::arg("max_depth"),
        py::arg("num_draft_tokens"), py::arg("min_token_prob"), py::arg("max_spec_factor"));
}
