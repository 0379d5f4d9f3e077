/* A step's jump-forward searches in one call (nbgen/runtime/grammar_search.py).
 *
 * xgrammar's matchers are tvm-ffi objects; their method find_jump_forward_string is a tvm-ffi Function.
 * Called from Python once per row, each call converts its argument and its result (a Python str) and
 * costs several times the search itself. Here the Function is called through tvm-ffi's C ABI for every
 * row in a loop (ctypes releases the GIL around the whole call); the rows whose forced text is not empty
 * are written out compactly.
 *
 * The few tvm-ffi ABI types needed are declared here (tvm/ffi/c_api.h: TVMFFIAny, TVMFFIObject, the
 * String object's layout { TVMFFIObject, TVMFFIByteArray }); the library's entry points come in as
 * pointers, so nothing links against libtvm_ffi.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef struct {          /* TVMFFIAny */
  int32_t type_index;
  uint32_t small_len;     /* zero_padding, or the small string's length */
  union { int64_t i; void* p; char b[8]; } v;
} FfiAny;

typedef struct {          /* TVMFFIObject: the header of every heap object */
  uint64_t ref_count;
  int32_t type_index;
  uint32_t pad;
  void* deleter;
} FfiObject;

typedef struct { const char* data; size_t size; } FfiBytes;   /* TVMFFIByteArray */

typedef int (*FfiCall)(void* func, FfiAny* args, int32_t num_args, FfiAny* result);
typedef int (*FfiDecRef)(void* obj);
typedef void (*FfiMoveError)(void** out);

enum { FFI_SMALL_STR = 11, FFI_OBJECT_BEGIN = 64, FFI_STR = 65 };

/* For each matcher handles[k] (k < n), func(handles[k]) -> its forced text. Returns m, the rows whose
 * text is not empty: row idx[j] (j < m) has lens[j] bytes, written one row after another into buf
 * (cap bytes, at least n), each followed by a '\0'; *used: the bytes written. lens[j] is -1 where the
 * call failed or gave no string, -2 where the text holds a '\0' or does not fit; such a row writes only
 * its '\0' (the caller asks it again the usual way). */
int64_t jump_strings(void* call_fn, void* decref_fn, void* move_error_fn, void* func, void** handles,
                     int64_t n, char* buf, int64_t cap, int64_t* idx, int64_t* lens, int64_t* used) {
  FfiCall call = (FfiCall)call_fn;
  FfiDecRef decref = (FfiDecRef)decref_fn;
  FfiMoveError move_error = (FfiMoveError)move_error_fn;
  int64_t m = 0, pos = 0;
  for (int64_t k = 0; k < n; k++) {
    FfiAny arg, res;
    memset(&arg, 0, sizeof arg);
    memset(&res, 0, sizeof res);
    arg.type_index = ((FfiObject*)handles[k])->type_index;   /* an object argument: its own type index */
    arg.v.p = handles[k];
    int64_t size = -1;
    const char* data = NULL;
    if (call(func, &arg, 1, &res) != 0) {
      void* err = NULL;
      move_error(&err);                                       /* take the raised error off this thread */
      if (err != NULL) decref(err);
    } else if (res.type_index == FFI_SMALL_STR) {
      data = res.v.b;
      size = res.small_len;
    } else if (res.type_index == FFI_STR) {
      const FfiBytes* bytes = (const FfiBytes*)((const char*)res.v.p + sizeof(FfiObject));
      data = bytes->data;
      size = (int64_t)bytes->size;
    }
    if (size != 0) {
      /* the rows after this one need a byte each for their '\0', so this one may use the rest */
      if (size > 0 && (pos + size + 1 + (n - k - 1) > cap || memchr(data, 0, (size_t)size) != NULL)) size = -2;
      if (size > 0) {
        memcpy(buf + pos, data, (size_t)size);
        pos += size;
      }
      buf[pos++] = '\0';
      idx[m] = k;
      lens[m++] = size;
    }
    if (res.type_index >= FFI_OBJECT_BEGIN) decref(res.v.p);
  }
  *used = pos;
  return m;
}
