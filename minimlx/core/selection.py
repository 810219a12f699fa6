"""The `k` largest values of a row, with ties broken as torch's CPU `topk` breaks them.

torch's CPU `topk(k)` (what transformers runs) pairs each value with its index and hands the row to libstdc++:
`std::partial_sort` over the first `k` when `64 * k <= n`, else `std::nth_element` at `k - 1`, both ordering by value
alone. Which of several equal values at the k-th place it keeps then depends on how those algorithms move the
row's elements, not on their indices: `kept` replays them (introselect: median-of-three quickselect, insertion sort
on the last few, heap selection past the depth limit) on a row's values and returns the indices kept.
"""


def kept(values: list[float], k: int) -> list[int]:
    """The indices of the `k` values torch's CPU topk(k) of `values` keeps, ascending."""
    row = [(v, i) for i, v in enumerate(values)]
    if k * 64 <= len(row):
        heap_select(row, 0, k, len(row))
    else:
        nth_element(row, k - 1)
    return sorted(i for _, i in row[:k])


def before(x: tuple, y: tuple) -> bool:
    """torch's order for topk's largest values: by value, greater first (the index plays no part)."""
    return x[0] > y[0]


def nth_element(a: list, nth: int) -> None:
    """libstdc++'s `std::nth_element(a, a + nth, a + len(a))` (`__introselect`)."""
    first, last = 0, len(a)
    if nth == last:
        return
    depth = 2 * (len(a).bit_length() - 1)  # 2 * floor(log2(n))
    while last - first > 3:
        if depth == 0:
            heap_select(a, first, nth + 1, last)
            a[first], a[nth] = a[nth], a[first]
            return
        depth -= 1
        median_to_first(a, first, first + 1, first + (last - first) // 2, last - 1)
        cut = unguarded_partition(a, first + 1, last, first)
        first, last = (cut, last) if cut <= nth else (first, cut)
    insertion_sort(a, first, last)


def median_to_first(a: list, result: int, i: int, j: int, k: int) -> None:
    """`__move_median_to_first`: the median of a[i], a[j], a[k] swapped into a[result]."""
    if before(a[i], a[j]):
        m = j if before(a[j], a[k]) else k if before(a[i], a[k]) else i
    else:
        m = i if before(a[i], a[k]) else k if before(a[j], a[k]) else j
    a[result], a[m] = a[m], a[result]


def unguarded_partition(a: list, first: int, last: int, pivot: int) -> int:
    while True:
        while before(a[first], a[pivot]):
            first += 1
        last -= 1
        while before(a[pivot], a[last]):
            last -= 1
        if first >= last:
            return first
        a[first], a[last] = a[last], a[first]
        first += 1


def insertion_sort(a: list, first: int, last: int) -> None:
    for i in range(first + 1, last):
        value = a[i]
        if before(value, a[first]):
            a[first + 1 : i + 1] = a[first:i]
            a[first] = value
        else:
            j = i
            while before(value, a[j - 1]):
                a[j] = a[j - 1]
                j -= 1
            a[j] = value


def heap_select(a: list, first: int, middle: int, last: int) -> None:
    """`__heap_select`: a[first:middle] made a heap (its top the least kept), then each later element that comes
    before the top replaces it."""
    length = middle - first
    for parent in range((length - 2) // 2, -1, -1) if length >= 2 else ():
        adjust_heap(a, first, parent, length, a[first + parent])
    for i in range(middle, last):
        if before(a[i], a[first]):
            value, a[i] = a[i], a[first]
            adjust_heap(a, first, 0, length, value)


def adjust_heap(a: list, first: int, hole: int, length: int, value: tuple) -> None:
    """`__adjust_heap`: the hole sifted down to a leaf, then `value` pushed up from there (`__push_heap`)."""
    top = second = hole
    while second < (length - 1) // 2:
        second = 2 * (second + 1)
        if before(a[first + second], a[first + second - 1]):
            second -= 1
        a[first + hole] = a[first + second]
        hole = second
    if length % 2 == 0 and second == (length - 2) // 2:
        second = 2 * (second + 1)
        a[first + hole] = a[first + second - 1]
        hole = second - 1
    parent = (hole - 1) // 2
    while hole > top and before(a[first + parent], value):
        a[first + hole] = a[first + parent]
        hole, parent = parent, (parent - 1) // 2
    a[first + hole] = value
