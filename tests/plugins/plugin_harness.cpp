// Test driver for libkvzap_trt_plugin.so (tests/plugins/test_cuda_build.py), compiled against real TensorRT
// headers where they exist. It loads the library the way IPluginRegistry::loadLibrary does (dlopen + getCreators)
// and calls the creator and plugin interfaces the way the builder and runtime call them, except for what needs a
// GPU or TensorRT's own objects (enqueue, getOutputShapes with an IExprBuilder). Prints "ok" and exits 0, or
// prints the first failed check and exits 1.
//   usage: plugin_harness path/to/libkvzap_trt_plugin.so
#include <NvInferRuntime.h>
#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <initializer_list>

using namespace nvinfer1;

#define CHECK(cond)                                              \
  do {                                                           \
    if (!(cond)) {                                               \
      std::printf("FAILED (line %d): %s\n", __LINE__, #cond);    \
      return 1;                                                  \
    }                                                            \
  } while (0)

namespace {

using GetCreators = IPluginCreatorInterface* const* (*)(int32_t&);

// The sink a plugin serializes, or -1 when its fields are not exactly {sink: one int32}.
int64_t serializedSink(IPluginV3* plugin) {
  auto* runtime = static_cast<IPluginV3OneRuntime*>(plugin->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
  PluginFieldCollection const* fields = runtime->getFieldsToSerialize();
  if (fields == nullptr || fields->nbFields != 1 || std::strcmp(fields->fields[0].name, "sink") != 0 ||
      fields->fields[0].type != PluginFieldType::kINT32 || fields->fields[0].length != 1) {
    return -1;
  }
  return *static_cast<int32_t const*>(fields->fields[0].data);
}

DynamicPluginTensorDesc tensor(DataType type, TensorFormat format = TensorFormat::kLINEAR) {
  DynamicPluginTensorDesc desc{};
  desc.desc.type = type;
  desc.desc.format = format;
  return desc;
}

}  // namespace

int main(int argc, char** argv) {
  CHECK(argc == 2);
  void* library = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) std::printf("%s\n", dlerror());
  CHECK(library != nullptr);
  auto getCreators = reinterpret_cast<GetCreators>(dlsym(library, "getCreators"));
  CHECK(getCreators != nullptr);
  CHECK(dlsym(library, "setLoggerFinder") != nullptr);

  int32_t count = 0;
  IPluginCreatorInterface* const* creators = getCreators(count);
  CHECK(count == 1 && creators != nullptr && creators[0] != nullptr);
  CHECK(std::strcmp(creators[0]->getInterfaceInfo().kind, "PLUGIN CREATOR_V3ONE") == 0);
  auto* creator = static_cast<IPluginCreatorV3One*>(creators[0]);
  CHECK(std::strcmp(creator->getPluginName(), "KVzapThresholdCompaction") == 0);
  CHECK(std::strcmp(creator->getPluginVersion(), "1") == 0);
  CHECK(std::strcmp(creator->getPluginNamespace(), "kvzap") == 0);
  PluginFieldCollection const* names = creator->getFieldNames();
  CHECK(names != nullptr && names->nbFields == 1 && std::strcmp(names->fields[0].name, "sink") == 0);
  CHECK(names->fields[0].type == PluginFieldType::kINT32);

  // As the ONNX parser creates it: INT attribute -> kINT32 field.
  int32_t sink = 4;
  PluginField field("sink", &sink, PluginFieldType::kINT32, 1);
  PluginFieldCollection fields{1, &field};
  IPluginV3* plugin = creator->createPlugin("node", &fields, TensorRTPhase::kBUILD);
  CHECK(plugin != nullptr);
  CHECK(std::strcmp(plugin->getInterfaceInfo().kind, "PLUGIN") == 0);

  auto* core = static_cast<IPluginV3OneCore*>(plugin->getCapabilityInterface(PluginCapabilityType::kCORE));
  CHECK(core != nullptr && std::strcmp(core->getInterfaceInfo().kind, "PLUGIN_V3ONE_CORE") == 0);
  CHECK(std::strcmp(core->getPluginName(), "KVzapThresholdCompaction") == 0);
  CHECK(std::strcmp(core->getPluginVersion(), "1") == 0 && std::strcmp(core->getPluginNamespace(), "kvzap") == 0);

  auto* build = static_cast<IPluginV3OneBuild*>(plugin->getCapabilityInterface(PluginCapabilityType::kBUILD));
  CHECK(build != nullptr && std::strcmp(build->getInterfaceInfo().kind, "PLUGIN_V3ONE_BUILD") == 0);
  CHECK(build->getNbOutputs() == 3);
  for (DataType scores : {DataType::kFLOAT, DataType::kHALF, DataType::kBF16}) {
    DataType inputs[4] = {scores, DataType::kINT32, DataType::kFLOAT, DataType::kINT32};
    DataType outputs[3] = {DataType::kFLOAT, DataType::kFLOAT, DataType::kFLOAT};
    CHECK(build->getOutputDataTypes(outputs, 3, inputs, 4) == 0);
    CHECK(outputs[0] == DataType::kINT32 && outputs[1] == DataType::kINT32 && outputs[2] == DataType::kINT32);
  }
  DataType intScores[4] = {DataType::kINT32, DataType::kINT32, DataType::kFLOAT, DataType::kINT32};
  DataType unused[3];
  CHECK(build->getOutputDataTypes(unused, 3, intScores, 4) != 0);

  DynamicPluginTensorDesc io[7] = {tensor(DataType::kBF16),  tensor(DataType::kINT32), tensor(DataType::kFLOAT),
                                   tensor(DataType::kINT32), tensor(DataType::kINT32), tensor(DataType::kINT32),
                                   tensor(DataType::kINT32)};
  for (int32_t pos = 0; pos < 7; ++pos) CHECK(build->supportsFormatCombination(pos, io, 4, 3));
  io[0] = tensor(DataType::kINT32);
  CHECK(!build->supportsFormatCombination(0, io, 4, 3));
  io[0] = tensor(DataType::kHALF, TensorFormat::kHWC8);
  CHECK(!build->supportsFormatCombination(0, io, 4, 3));
  io[4] = tensor(DataType::kBOOL);  // TensorRT plugins cannot output bool: keep is int32
  CHECK(!build->supportsFormatCombination(4, io, 4, 3));
  io[1] = tensor(DataType::kINT64);
  CHECK(!build->supportsFormatCombination(1, io, 4, 3));
  io[2] = tensor(DataType::kHALF);
  CHECK(!build->supportsFormatCombination(2, io, 4, 3));
  CHECK(!build->supportsFormatCombination(7, io, 4, 3));
  CHECK(build->configurePlugin(io, 4, io + 4, 3) == 0 && build->getWorkspaceSize(io, 4, io + 4, 3) == 0);

  auto* runtime = static_cast<IPluginV3OneRuntime*>(plugin->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
  CHECK(runtime != nullptr && std::strcmp(runtime->getInterfaceInfo().kind, "PLUGIN_V3ONE_RUNTIME") == 0);
  PluginTensorDesc shapes[7]{};
  shapes[0].dims.nbDims = 3;
  shapes[0].dims.d[0] = 2, shapes[0].dims.d[1] = 8, shapes[0].dims.d[2] = 4096;
  CHECK(runtime->onShapeChange(shapes, 4, shapes + 4, 3) == 0);
  shapes[0].dims.nbDims = 2;
  CHECK(runtime->onShapeChange(shapes, 4, shapes + 4, 3) != 0);

  // Serialization round trip: the runtime recreates the plugin from getFieldsToSerialize().
  CHECK(serializedSink(plugin) == 4);
  PluginFieldCollection const* saved = runtime->getFieldsToSerialize();
  IPluginV3* restored = creator->createPlugin("node", saved, TensorRTPhase::kRUNTIME);
  CHECK(restored != nullptr && serializedSink(restored) == 4);
  IPluginV3* cloned = plugin->clone();
  CHECK(cloned != nullptr && cloned != plugin && serializedSink(cloned) == 4);
  IPluginV3* attached = runtime->attachToContext(nullptr);
  CHECK(attached != nullptr && serializedSink(attached) == 4);
  delete attached;
  delete cloned;
  delete restored;
  delete plugin;

  // Field variants: int64 accepted, absent means 0, negative or non-integer refused.
  int64_t wide = 7;
  PluginField wideField("sink", &wide, PluginFieldType::kINT64, 1);
  PluginFieldCollection wideFields{1, &wideField};
  IPluginV3* fromWide = creator->createPlugin("node", &wideFields, TensorRTPhase::kBUILD);
  CHECK(fromWide != nullptr && serializedSink(fromWide) == 7);
  delete fromWide;
  PluginFieldCollection none{0, nullptr};
  IPluginV3* fromNone = creator->createPlugin("node", &none, TensorRTPhase::kBUILD);
  CHECK(fromNone != nullptr && serializedSink(fromNone) == 0);
  delete fromNone;
  int32_t negative = -1;
  PluginField negativeField("sink", &negative, PluginFieldType::kINT32, 1);
  PluginFieldCollection negativeFields{1, &negativeField};
  CHECK(creator->createPlugin("node", &negativeFields, TensorRTPhase::kBUILD) == nullptr);
  float real = 1.0F;
  PluginField realField("sink", &real, PluginFieldType::kFLOAT32, 1);
  PluginFieldCollection realFields{1, &realField};
  CHECK(creator->createPlugin("node", &realFields, TensorRTPhase::kBUILD) == nullptr);

  std::printf("ok\n");
  return 0;
}
