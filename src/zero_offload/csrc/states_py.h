// Python entry points of the compact-state update (adam_states.h), registered by host_adam.cpp
// in the zero_offload._host_adam module.
#pragma once

#include <Python.h>

#include "host_adam.h"

namespace zo {

// The variant host_adam.cpp selected (at import, or by set_isa).
const KernelSet* active_kernel_set();

PyObject* py_adam_step_states(PyObject* self, PyObject* args);
PyObject* py_sr_round_bf16(PyObject* self, PyObject* args);
PyObject* py_quant_maps(PyObject* self, PyObject* args);

extern const char kAdamStepStatesDoc[];
extern const char kSrRoundDoc[];
extern const char kQuantMapsDoc[];

}  // namespace zo
