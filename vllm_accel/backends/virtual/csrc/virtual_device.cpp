// The virtual card: a real torch device (PrivateUse1, renamed "gcu" or "tpu" from
// Python, after the vendor library it stands in for)
// whose memory is host memory and whose kernels are the CPU's.
//
// * Memory: every device tensor is allocated here, with per-device accounting
//   (allocated, peak) against a capacity; going past it raises
//   torch.OutOfMemoryError like a card.
// * Kernels: an op with no registration of its own for PrivateUse1 reaches the
//   boxed fallback below, which runs the CPU kernel on CPU views of the same
//   memory (no copies): in-place and out= results land in device memory
//   directly, views come back as views of the device storage, and new results
//   are adopted into device storage (accounted like any allocation).
// * Device selection, streams and events are synchronous (the CPU computes in
//   program order), as the device guard below reports.
//
// Loaded with torch.ops.load_library (vllm_accel/backends/virtual_gcu/build.py);
// the Python side (device module, renaming, distributed backend) is
// vllm_accel/backends/virtual_gcu/device.py.

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/CachingHostAllocator.h>
#include <ATen/core/GeneratorForPrivateuseone.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/view_native.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <c10/core/Allocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>

namespace vdevice {

using c10::DeviceIndex;
using c10::DeviceType;

constexpr DeviceIndex kMaxDevices = 16;
constexpr size_t kAlignment = 64;

struct DeviceMemory {
  std::atomic<int64_t> allocated{0};
  std::atomic<int64_t> peak{0};
};

std::array<DeviceMemory, kMaxDevices> g_memory;
std::atomic<int> g_device_count{1};
std::atomic<int64_t> g_capacity{int64_t(1) << 30};
thread_local DeviceIndex t_current_device = 0;

c10::Device device_at(DeviceIndex index) { return c10::Device(DeviceType::PrivateUse1, index); }

// What PrivateUse1 is called now ("gcu", "tpu"), for messages.
std::string device_name() { return c10::get_privateuse1_backend(); }

void check_index(int64_t index) {
  TORCH_CHECK(index >= 0 && index < g_device_count.load(), device_name(), ":", index,
              " does not exist: the virtual device has ", g_device_count.load(),
              " device(s) (ACCEL_VIRTUAL_DEVICE_COUNT, then the vendor's visibility variable)");
}

// Accounts `bytes` on `device`, or raises torch.OutOfMemoryError past the capacity.
void charge(DeviceIndex device, int64_t bytes) {
  auto& mem = g_memory[device];
  const int64_t now = mem.allocated.fetch_add(bytes) + bytes;
  if (now > g_capacity.load()) {
    mem.allocated.fetch_sub(bytes);
    TORCH_CHECK_WITH(OutOfMemoryError, false, device_name(), ":", int(device), " out of memory: tried to ",
                     "allocate ", bytes, " bytes with ", now - bytes, " of ", g_capacity.load(),
                     " bytes in use (virtual device capacity: ACCEL_SIM_DEVICE_MEMORY_GB)");
  }
  int64_t peak = mem.peak.load();
  while (now > peak && !mem.peak.compare_exchange_weak(peak, now)) {
  }
}

// What a device allocation's deleter needs: the host block and what to un-charge.
struct Block {
  void* host;  // freed with `free_host`
  c10::DeleterFnPtr free_host;
  int64_t bytes;
  DeviceIndex device;
};

void release_block(void* ctx) {
  auto* block = static_cast<Block*>(ctx);
  if (block->free_host) block->free_host(block->host);
  g_memory[block->device].allocated.fetch_sub(block->bytes);
  delete block;
}

void free_aligned(void* p) { std::free(p); }

// Host memory for `nbytes` (null for 0), aligned for vector loads.
void* alloc_aligned(size_t nbytes) {
  return nbytes ? std::aligned_alloc(kAlignment, (nbytes + kAlignment - 1) / kAlignment * kAlignment)
                : nullptr;
}

// A DeviceAllocator (what torch.accelerator's memory functions ask for):
// nothing is cached, so "reserved" equals "allocated".
struct VirtualAllocator final : c10::DeviceAllocator {
  c10::DataPtr allocate(size_t nbytes) override {
    const DeviceIndex device = t_current_device;
    charge(device, int64_t(nbytes));
    void* host = alloc_aligned(nbytes);
    if (nbytes && !host) {
      g_memory[device].allocated.fetch_sub(int64_t(nbytes));
      TORCH_CHECK_WITH(OutOfMemoryError, false, device_name(), ":", int(device), ": the host could not ",
                       "provide ", nbytes, " bytes");
    }
    return {host, new Block{host, &free_aligned, int64_t(nbytes), device}, &release_block,
            device_at(device)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

  bool initialized() override { return true; }
  void emptyCache(c10::MempoolId_t) override {}
  void recordStream(const c10::DataPtr&, c10::Stream) override {}
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(DeviceIndex device) override {
    c10::CachingDeviceAllocator::DeviceStats stats;
    const auto all = size_t(c10::CachingAllocator::StatType::AGGREGATE);
    for (auto* array : {&stats.allocated_bytes, &stats.reserved_bytes, &stats.active_bytes,
                        &stats.requested_bytes}) {
      (*array)[all].current = g_memory[device].allocated.load();
      (*array)[all].peak = g_memory[device].peak.load();
    }
    return stats;
  }
  void resetAccumulatedStats(DeviceIndex) override {}
  void resetPeakStats(DeviceIndex device) override {
    g_memory[device].peak = g_memory[device].allocated.load();
  }
  std::pair<size_t, size_t> getMemoryInfo(DeviceIndex device) override {
    const int64_t total = g_capacity.load();
    return {size_t(total - g_memory[device].allocated.load()), size_t(total)};
  }
};

VirtualAllocator g_allocator;
REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &g_allocator)

// Moves a CPU tensor's memory into device ownership (charged to `device`):
// the fallback's new results, without a copy.
at::Tensor adopt(const at::Tensor& cpu, DeviceIndex device) {
  auto contiguous = cpu;
  if (cpu.storage().use_count() != 1 || cpu.storage().data_ptr().device().type() != DeviceType::CPU) {
    contiguous = cpu.clone();  // shared or foreign memory: take a private copy first
  }
  c10::Storage storage = contiguous.storage();
  const int64_t bytes = int64_t(storage.nbytes());
  charge(device, bytes);
  c10::DataPtr& cpu_ptr = storage.unsafeGetStorageImpl()->mutable_data_ptr();
  void* data = cpu_ptr.get();
  auto ctx = cpu_ptr.move_context();
  auto* block = new Block{ctx.release(), ctx.get_deleter(), bytes, device};
  c10::DataPtr device_ptr(data, block, &release_block, device_at(device));
  auto device_storage = c10::Storage(c10::Storage::use_byte_size_t(), storage.nbytes(),
                                     std::move(device_ptr), &g_allocator, false);
  storage.unsafeGetStorageImpl()->set_data_ptr_noswap(c10::DataPtr());  // ownership moved
  auto out = at::detail::make_tensor<c10::TensorImpl>(
      std::move(device_storage), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
      contiguous.dtype());
  out.unsafeGetTensorImpl()->set_sizes_and_strides(contiguous.sizes(), contiguous.strides(),
                                                   contiguous.storage_offset());
  return out;
}

// A CPU tensor over a device tensor's memory (same storage base, offset,
// sizes and strides). The device tensor must outlive it.
// With `resizable`, a CPU kernel may resize it (out= arguments): its storage
// then moves to new CPU memory, and the fallback moves the result back. With
// `keep_alive`, the view holds a reference to the device storage (for views
// that leave the fallback, e.g. to gloo).
at::Tensor cpu_view(const at::Tensor& t, bool resizable = false, bool keep_alive = false) {
  const auto& storage = t.storage();
  auto maker = at::for_blob(storage.mutable_data(), t.sizes());
  maker.strides(t.strides())
      .storage_offset(t.storage_offset())
      .options(at::TensorOptions().dtype(t.dtype()).device(at::kCPU));
  if (keep_alive)
    maker.context(new c10::Storage(storage), [](void* s) { delete static_cast<c10::Storage*>(s); });
  else
    maker.context(nullptr, [](void*) {});
  if (resizable) maker.resizeable_storage().allocator(c10::GetCPUAllocator());
  return maker.make_tensor();
}

// ------------------------------------------------------------------ generators

// The device's generator: a CPU generator underneath (the kernels are the CPU's).
struct VirtualGenerator final : c10::GeneratorImpl {
  explicit VirtualGenerator(DeviceIndex index)
      : c10::GeneratorImpl(device_at(index), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
        cpu(at::make_generator<at::CPUGeneratorImpl>(c10::default_rng_seed_val)) {}
  void set_current_seed(uint64_t seed) override { cpu.set_current_seed(seed); }
  void set_offset(uint64_t offset) override { cpu.set_offset(offset); }
  uint64_t get_offset() const override { return cpu.get_offset(); }
  uint64_t current_seed() const override { return cpu.current_seed(); }
  uint64_t seed() override { return cpu.seed(); }
  void set_state(const c10::TensorImpl& state) override { cpu.unsafeGetGeneratorImpl()->set_state(state); }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    return cpu.unsafeGetGeneratorImpl()->get_state();
  }
  VirtualGenerator* clone_impl() const override {
    auto* copy = new VirtualGenerator(device().index());
    copy->cpu = cpu.clone();
    return copy;
  }
  at::Generator cpu;
};

at::Generator new_generator(DeviceIndex index) {
  return at::make_generator<VirtualGenerator>(index < 0 ? t_current_device : index);
}

const at::Generator& default_generator(DeviceIndex index) {
  static std::array<at::Generator, kMaxDevices> generators;
  static std::once_flag once;
  std::call_once(once, [] {
    for (DeviceIndex i = 0; i < kMaxDevices; ++i) generators[i] = new_generator(i);
  });
  const DeviceIndex i = index < 0 ? t_current_device : index;
  check_index(i);
  return generators[i];
}

// ------------------------------------------------------------------ device guard

// Events record a wall-clock time; everything is complete once issued.
struct Event {
  std::chrono::steady_clock::time_point at;
};

struct VirtualGuard final : c10::impl::DeviceGuardImplInterface {
  static constexpr DeviceType static_type = DeviceType::PrivateUse1;
  DeviceType type() const override { return DeviceType::PrivateUse1; }
  c10::Device exchangeDevice(c10::Device d) const override {
    auto old = getDevice();
    setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return device_at(t_current_device); }
  void setDevice(c10::Device d) const override {
    check_index(d.index());
    t_current_device = d.index();
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override { t_current_device = d.index(); }
  c10::Stream getStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::DEFAULT, d);
  }
  c10::Stream getNewStream(c10::Device d, int) const override {
    return c10::Stream(c10::Stream::DEFAULT, d);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    return c10::Stream(c10::Stream::DEFAULT, s.device());
  }
  DeviceIndex deviceCount() const noexcept override { return DeviceIndex(g_device_count.load()); }
  void record(void** event, const c10::Stream&, const DeviceIndex, const c10::EventFlag) const override {
    if (!*event) *event = new Event;
    static_cast<Event*>(*event)->at = std::chrono::steady_clock::now();
  }
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void* event, const DeviceIndex) const noexcept override {
    delete static_cast<Event*>(event);
  }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const DeviceIndex) const override {}
  double elapsedTime(void* start, void* end, const DeviceIndex) const override {
    TORCH_CHECK(start && end, "elapsed_time needs two recorded events");
    return std::chrono::duration<double, std::milli>(static_cast<Event*>(end)->at -
                                                     static_cast<Event*>(start)->at).count();
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, VirtualGuard);

// ------------------------------------------------------------------ hooks

// Pinned host memory: ordinary host memory, remembered so is_pinned() is true.
std::mutex g_pinned_mutex;
std::set<const void*> g_pinned;

void free_pinned(void* p) {
  {
    std::lock_guard<std::mutex> lock(g_pinned_mutex);
    g_pinned.erase(p);
  }
  std::free(p);
}

// A HostAllocator, registered for the device as a card's pinned allocator is
// (torch.accelerator's host-cache calls reach it); nothing is cached.
struct PinnedAllocator final : at::HostAllocator {
  c10::DataPtr allocate(size_t nbytes) override {
    void* p = alloc_aligned(nbytes);
    TORCH_CHECK(!nbytes || p, "could not allocate ", nbytes, " bytes of pinned host memory");
    if (p) {
      std::lock_guard<std::mutex> lock(g_pinned_mutex);
      g_pinned.insert(p);
    }
    return {p, p, &free_pinned, c10::Device(DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_pinned; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
  bool record_event(void*, void*, c10::Stream) override { return true; }
  void empty_cache() override {}
  at::HostStats get_stats() override { return {}; }
  void reset_accumulated_stats() override {}
  void reset_peak_stats() override {}
};

PinnedAllocator g_pinned_allocator;
REGISTER_HOST_ALLOCATOR(at::kPrivateUse1, &g_pinned_allocator)

struct VirtualHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return g_device_count.load() > 0; }
  const at::Generator& getDefaultGenerator(DeviceIndex index) const override {
    return default_generator(index);
  }
  at::Generator getNewGenerator(DeviceIndex index) const override { return new_generator(index); }
  at::Device getDeviceFromPtr(void*) const override { return device_at(t_current_device); }
  bool isPinnedPtr(const void* data) const override {
    std::lock_guard<std::mutex> lock(g_pinned_mutex);
    return g_pinned.count(data) > 0;
  }
  c10::Allocator* getPinnedMemoryAllocator() const override { return &g_pinned_allocator; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
  DeviceIndex deviceCount() const override { return DeviceIndex(g_device_count.load()); }
  void setCurrentDevice(DeviceIndex d) const override {
    check_index(d);
    t_current_device = d;
  }
  DeviceIndex getCurrentDevice() const override { return t_current_device; }
  DeviceIndex exchangeDevice(DeviceIndex d) const override {
    auto old = t_current_device;
    setCurrentDevice(d);
    return old;
  }
  DeviceIndex maybeExchangeDevice(DeviceIndex d) const override { return exchangeDevice(d); }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    auto* impl = storage.unsafeGetStorageImpl();
    TORCH_CHECK(impl->resizable(), "Trying to resize storage that is not resizable");
    const c10::DeviceGuard guard(impl->device());
    c10::DataPtr fresh = g_allocator.allocate(newsize);
    const size_t keep = std::min(newsize, impl->nbytes());
    if (keep) std::memcpy(fresh.get(), impl->data(), keep);
    impl->set_data_ptr_noswap(std::move(fresh));
    impl->set_nbytes(newsize);
  }
};

// ------------------------------------------------------------------ ops

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<at::ScalarType> dtype,
                               std::optional<at::Layout>, std::optional<at::Device> device,
                               std::optional<bool>, std::optional<at::MemoryFormat> format) {
  const c10::DeviceGuard guard(device.value_or(device_at(t_current_device)));
  return at::detail::empty_generic(size, &g_allocator,
                                   c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         std::optional<at::ScalarType> dtype, std::optional<at::Layout>,
                         std::optional<at::Device> device, std::optional<bool>) {
  const c10::DeviceGuard guard(device.value_or(device_at(t_current_device)));
  return at::detail::empty_strided_generic(size, stride, &g_allocator,
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

const at::Tensor& resize_(const at::Tensor& self, c10::SymIntArrayRef size,
                          std::optional<at::MemoryFormat> format) {
  auto* impl = self.unsafeGetTensorImpl();
  const auto sizes = C10_AS_INTARRAYREF_SLOW(size);
  impl->set_sizes_contiguous(sizes);
  const int64_t needed = (impl->numel() + self.storage_offset()) * self.itemsize();
  if (impl->numel() > 0 && needed > int64_t(self.storage().nbytes())) {
    at::native::resize_bytes_nocuda(self.storage(), c10::SymInt(needed));
  }
  if (format.has_value()) {
    TORCH_CHECK(*format != at::MemoryFormat::Preserve, "resize_: Preserve is not supported");
    impl->empty_tensor_restride(*format);
  }
  return self;
}

at::Tensor& set_storage(at::Tensor& self, at::Storage source, int64_t offset,
                        c10::IntArrayRef size, c10::IntArrayRef stride) {
  return at::native::set_storage_cpu_(self, std::move(source), offset, size, stride);
}

// Copies between the host and the device, or within the device: one memcpy-like
// CPU copy (both are host memory).
at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool) {
  auto host = [](const at::Tensor& t) {
    return t.device().type() == DeviceType::PrivateUse1 ? cpu_view(t) : t;
  };
  host(dst).copy_(host(self));
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  dst.resize_(self.sizes());
  return copy_from(self, dst, false);
}

at::Tensor& set_source_storage(at::Tensor& self, at::Storage source) {
  const int64_t numel = int64_t(source.nbytes() / self.itemsize());
  return set_storage(self, std::move(source), 0, {numel}, {});
}

at::Tensor to_cpu_view(const at::Tensor& t, DeviceIndex& device, bool written = false) {
  if (t.defined() && t.device().type() == DeviceType::PrivateUse1) {
    device = t.device().index();
    return cpu_view(t, written);
  }
  return t;
}

// `cpu` (a view the CPU kernel made of `owner`'s CPU view) as a device view.
// A kernel that resized an out= argument moved it to new CPU memory: the
// device tensor is resized to match and receives the result.
at::Tensor device_view(const at::Tensor& owner, const at::Tensor& cpu) {
  if (cpu.storage().data() != owner.storage().data()) {
    owner.resize_(cpu.sizes());
    owner.unsafeGetTensorImpl()->set_sizes_and_strides(cpu.sizes(), cpu.strides(),
                                                       owner.storage_offset());
    cpu_view(owner).copy_(cpu);
    return owner;
  }
  if (owner.sizes() == cpu.sizes() && owner.strides() == cpu.strides() &&
      owner.storage_offset() == cpu.storage_offset())
    return owner;
  auto view = at::detail::make_tensor<c10::TensorImpl>(
      c10::TensorImpl::VIEW, c10::Storage(owner.storage()), owner.key_set(), owner.dtype());
  view.unsafeGetTensorImpl()->set_sizes_and_strides(cpu.sizes(), cpu.strides(),
                                                    cpu.storage_offset());
  return view;
}

// The argument a return aliases (in-place, out=, view ops), if any.
std::optional<size_t> aliased_argument(const c10::FunctionSchema& schema, size_t ret) {
  const auto* alias = schema.returns()[ret].alias_info();
  if (!alias) return std::nullopt;
  const auto& args = schema.arguments();
  for (size_t i = 0; i < args.size(); ++i)
    if (args[i].alias_info() && args[i].alias_info()->beforeSets() == alias->beforeSets())
      return i;
  return std::nullopt;
}

// A result of the CPU kernel back on the device: the device argument itself
// (in-place, out=), a view of its storage (view ops), or, for new results,
// adopted into device storage. CPU arguments returned as such stay on the CPU.
c10::IValue result_to_device(const c10::IValue& result, const c10::IValue* aliased,
                             DeviceIndex device) {
  auto one = [&](const at::Tensor& cpu, const c10::IValue* arg) -> at::Tensor {
    if (!cpu.defined()) return cpu;
    if (arg == nullptr) return adopt(cpu, device);
    if (!arg->isTensor()) return cpu;
    const at::Tensor& original = arg->toTensor();
    if (original.device().type() != DeviceType::PrivateUse1) return cpu;
    return device_view(original, cpu);
  };
  if (result.isTensor()) return one(result.toTensor(), aliased);
  if (result.isTensorList()) {
    c10::List<at::Tensor> out;
    const bool list_arg = aliased && aliased->isTensorList();
    auto originals = list_arg ? aliased->toTensorList() : c10::List<at::Tensor>();
    auto results = result.toTensorList();
    for (size_t i = 0; i < results.size(); ++i) {
      if (list_arg && i < originals.size()) {
        const c10::IValue original(originals.get(i));
        out.push_back(one(results.get(i), &original));
      } else {
        out.push_back(one(results.get(i), aliased));  // e.g. split: views of one tensor
      }
    }
    return out;
  }
  return result;
}

// Runs the CPU kernel of any op without a device registration, on CPU views of
// the device memory. An op the CPU lacks too fails with the dispatcher's error,
// which names it.
void cpu_kernel_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t num_args = schema.arguments().size();
  const size_t first = stack->size() - num_args;
  const std::vector<c10::IValue> originals(stack->begin() + first, stack->end());
  DeviceIndex device = t_current_device;
  std::optional<size_t> pending_default_generator;
  for (size_t i = first; i < stack->size(); ++i) {
    c10::IValue& v = (*stack)[i];
    const auto* alias = schema.arguments()[i - first].alias_info();
    if (v.isTensor()) {
      v = to_cpu_view(v.toTensor(), device, alias && alias->isWrite());
    } else if (v.isTensorList()) {
      c10::List<at::Tensor> views;
      for (const at::Tensor& t : v.toTensorList()) views.push_back(to_cpu_view(t, device));
      v = views;
    } else if (v.isOptionalTensorList()) {
      c10::List<std::optional<at::Tensor>> views;
      for (std::optional<at::Tensor> t : v.toOptionalTensorList())
        views.push_back(t.has_value() ? std::optional<at::Tensor>(to_cpu_view(*t, device)) : t);
      v = views;
    } else if (v.isGenerator()) {
      const auto& gen = v.toGenerator();
      if (gen.device().type() == DeviceType::PrivateUse1)
        v = static_cast<VirtualGenerator*>(gen.unsafeGetGeneratorImpl())->cpu;
    } else if (v.isNone() && schema.arguments()[i - first].name() == "generator") {
      pending_default_generator = i;  // the device's default, once the device is known
    } else if (v.isDevice() && v.toDevice().type() == DeviceType::PrivateUse1) {
      if (v.toDevice().has_index()) device = v.toDevice().index();
      v = c10::IValue(c10::Device(DeviceType::CPU));
    }
  }
  if (pending_default_generator) {
    const auto& gen = default_generator(device);
    (*stack)[*pending_default_generator] =
        static_cast<VirtualGenerator*>(gen.unsafeGetGeneratorImpl())->cpu;
  }
  try {
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
  } catch (const c10::NotImplementedError& e) {
    TORCH_CHECK_NOT_IMPLEMENTED(false, "'", schema.operator_name(), "' cannot run on the virtual ", device_name(),
                                ": it runs every op with the CPU's kernel, and this op has ",
                                "none. ", e.what_without_backtrace());
  }
  const size_t num_returns = schema.returns().size();
  const size_t first_return = stack->size() - num_returns;
  const c10::DeviceGuard guard(device_at(device));
  for (size_t r = 0; r < num_returns; ++r) {
    const auto arg = aliased_argument(schema, r);
    (*stack)[first_return + r] = result_to_device((*stack)[first_return + r],
                                                  arg ? &originals[*arg] : nullptr, device);
  }
}

}  // namespace vdevice

// Registered at load: the generator factory, the hooks.
namespace {
struct RegisterHooks {
  RegisterHooks() {
    static vdevice::VirtualHooks hooks;
    at::RegisterPrivateUse1HooksInterface(&hooks);
  }
} register_hooks;
}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", &vdevice::empty_memory_format);
  m.impl("empty_strided", &vdevice::empty_strided);
  m.impl("as_strided", TORCH_FN(at::native::as_strided_tensorimpl));
  m.impl("view", TORCH_FN(at::native::view));
  m.impl("_reshape_alias", TORCH_FN(at::native::_reshape_alias));
  m.impl("resize_", &vdevice::resize_);
  m.impl("_copy_from", &vdevice::copy_from);
  m.impl("_copy_from_and_resize", &vdevice::copy_from_and_resize);
  m.impl("set_.source_Storage", &vdevice::set_source_storage);
  m.impl("set_.source_Storage_storage_offset", &vdevice::set_storage);
  // torch's composite convolution sends a backend it does not know to
  // convolution_overrideable, whose only kernel throws (the fallback below never
  // sees it); a card's torch extension registers its own. Whisper's audio encoder
  // (Conv1d) needs it: the CPU's kernel, as for every other op.
  m.impl("convolution", torch::CppFunction::makeFromBoxedFunction<&vdevice::cpu_kernel_fallback>());
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&vdevice::cpu_kernel_fallback>());
}

// Python-facing controls and counters: torch.ops.vdevice.*
namespace vdevice {
void configure(int64_t count, int64_t capacity) {
  TORCH_CHECK(count >= 0 && count <= kMaxDevices, "the virtual device supports 0..", int(kMaxDevices),
              " devices, got ", count);
  TORCH_CHECK(capacity > 0, "the virtual device capacity must be positive, got ", capacity);
  g_device_count = int(count);
  g_capacity = capacity;
}
int64_t memory_allocated(int64_t device) {
  check_index(device);
  return g_memory[device].allocated.load();
}
int64_t max_memory_allocated(int64_t device) {
  check_index(device);
  return g_memory[device].peak.load();
}
void reset_peak_memory_stats(int64_t device) {
  check_index(device);
  g_memory[device].peak = g_memory[device].allocated.load();
}
// A CPU tensor over a device tensor's memory that keeps the device storage
// alive (the eccl backend hands these to gloo: collectives in place, no copies).
at::Tensor host_view(const at::Tensor& t) {
  return t.device().type() == DeviceType::PrivateUse1 ? cpu_view(t, false, true) : t;
}
void manual_seed(int64_t device, int64_t seed) {
  auto gen = default_generator(DeviceIndex(device));
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_current_seed(uint64_t(seed));
}
int64_t initial_seed(int64_t device) {
  return int64_t(default_generator(DeviceIndex(device)).current_seed());
}
int64_t seed(int64_t device) {
  auto gen = default_generator(DeviceIndex(device));
  std::lock_guard<std::mutex> lock(gen.mutex());
  return int64_t(gen.seed());
}
int64_t device_count() { return g_device_count.load(); }
int64_t current_device() { return t_current_device; }
void set_device(int64_t device) {
  check_index(device);
  t_current_device = DeviceIndex(device);
}
}  // namespace vdevice

TORCH_LIBRARY(vdevice, m) {
  m.def("configure(int count, int capacity) -> ()", &vdevice::configure);
  m.def("memory_allocated(int device) -> int", &vdevice::memory_allocated);
  m.def("max_memory_allocated(int device) -> int", &vdevice::max_memory_allocated);
  m.def("reset_peak_memory_stats(int device) -> ()", &vdevice::reset_peak_memory_stats);
  m.def("host_view(Tensor t) -> Tensor", &vdevice::host_view);
  m.def("manual_seed(int device, int seed) -> ()", &vdevice::manual_seed);
  m.def("initial_seed(int device) -> int", &vdevice::initial_seed);
  m.def("seed(int device) -> int", &vdevice::seed);
  m.def("device_count() -> int", &vdevice::device_count);
  m.def("current_device() -> int", &vdevice::current_device);
  m.def("set_device(int device) -> ()", &vdevice::set_device);
}
