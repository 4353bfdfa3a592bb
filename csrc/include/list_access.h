// What an element op does with each of its lists: the element type, and whether it reads and/or
// writes it. The vectorised CUDA driver (cuda/multi_tensor_apply.cuh) stages exactly these lists in
// registers with 16-byte loads/stores and leaves the others untouched; the CPU driver ignores it.
//
// An op declares `using lists = ListAccess<...>` with one entry per list (as many as `depth`):
//   In<T>     read only (never stored back: no write traffic)
//   Out<T>    written for EVERY element it is called on (never loaded: a conditional write would store garbage)
//   InOut<T>  read and written
//   Unused    not touched for this instance (e.g. the Kahan list of an fp32 instance)
#pragma once

#include <type_traits>

namespace lo {

template <typename T, bool READ, bool WRITE>
struct Access {
  using type = T;
  static constexpr bool read = READ, write = WRITE, used = READ || WRITE;
};

template <typename T> using In = Access<T, true, false>;
template <typename T> using Out = Access<T, false, true>;
template <typename T> using InOut = Access<T, true, true>;
using Unused = Access<void, false, false>;
template <bool B, class A> using UsedIf = std::conditional_t<B, A, Unused>;

namespace access_detail {
template <typename T> constexpr int size_or_16() {
  if constexpr (std::is_void<T>::value) return 16;
  else return static_cast<int>(sizeof(T));
}
template <class... A> constexpr int min_used_size() {
  int m = 16;
  ((m = (A::used && size_or_16<typename A::type>() < m) ? size_or_16<typename A::type>() : m), ...);
  return m;
}
}  // namespace access_detail

template <class... A>
struct ListAccess {
  static constexpr int depth = sizeof...(A);
  static constexpr int used = (0 + ... + static_cast<int>(A::used));
  // the smallest element among the used lists: how many elements one 16-byte access of it holds
  static constexpr int min_size = access_detail::min_used_size<A...>();
};

// List l of an access list: its Access entry, and its slot among the used lists (-1: unused).
template <int L, class Lists> struct ListAt;
template <int L, class First, class... Rest>
struct ListAt<L, ListAccess<First, Rest...>> : ListAt<L - 1, ListAccess<Rest...>> {
  static constexpr int slot = ListAt<L - 1, ListAccess<Rest...>>::slot < 0
                                  ? -1
                                  : ListAt<L - 1, ListAccess<Rest...>>::slot + static_cast<int>(First::used);
};
template <class First, class... Rest>
struct ListAt<0, ListAccess<First, Rest...>> {
  using access = First;
  static constexpr int slot = First::used ? 0 : -1;
};

}  // namespace lo
