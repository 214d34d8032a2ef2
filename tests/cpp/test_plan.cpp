// The plan (csrc/plan.h): its int form, which the op schemas carry, and its
// name.
#include <c10/util/Exception.h>

#include <set>
#include <string>

#include "plan.h"
#include "support.h"

using Catch::Matchers::Contains;
using openwam::Plan;

namespace {

Plan make(bool mask, bool pad_bwd, bool pad_fwd, bool pad_query) {
  Plan p;
  p.padding_mask = mask;
  p.pad_keys_backward = pad_bwd;
  p.pad_keys_forward = pad_fwd;
  p.pad_query_backward = pad_query;
  return p;
}

}  // namespace

TEST_CASE("plan: the default plan is none", "[plan]") {
  const Plan p;
  CHECK(p.none());
  CHECK_FALSE(p.pads_keys());
  CHECK_FALSE(p.pads_inputs());
  CHECK(p.to_int() == 0);
  CHECK(p.to_string() == "none");
}

TEST_CASE("plan: each flag has its own bit", "[plan]") {
  // The bits are part of the op schema's contract (a saved graph holds them).
  CHECK(make(true, false, false, false).to_int() == 1);
  CHECK(make(false, true, false, false).to_int() == 2);
  CHECK(make(false, false, true, false).to_int() == 4);
  CHECK(make(false, false, false, true).to_int() == 8);
  Plan shift;
  shift.shift_scores = true;
  CHECK(shift.to_int() == 16);
  CHECK(shift.to_string() == "shift_scores");
  CHECK_FALSE(shift.none());
  CHECK_FALSE(shift.pads_inputs());  // no padded input on either engine
}

TEST_CASE("plan: to_int / from_int round trip every combination", "[plan]") {
  std::set<std::string> names;
  for (int64_t bits = 0; bits < 32; ++bits) {
    CAPTURE(bits);
    const Plan p = Plan::from_int(bits);
    CHECK(p.to_int() == bits);
    CHECK(p.padding_mask == ((bits & 1) != 0));
    CHECK(p.pad_keys_backward == ((bits & 2) != 0));
    CHECK(p.pad_keys_forward == ((bits & 4) != 0));
    CHECK(p.pad_query_backward == ((bits & 8) != 0));
    CHECK(p.shift_scores == ((bits & 16) != 0));
    CHECK(p.none() == (bits == 0));
    CHECK(p.pads_keys() == ((bits & 6) != 0));
    // The padding mask is the frontend's fix; the ATen fallback pads inputs.
    CHECK(p.pads_inputs() == ((bits & 14) != 0));
    CHECK(Plan::from_int(p.to_int()) == p);
    for (int64_t other = 0; other < 32; ++other) {
      CHECK((Plan::from_int(other) == p) == (other == bits));
      CHECK((Plan::from_int(other) != p) == (other != bits));
    }
    names.insert(p.to_string());
  }
  CHECK(names.size() == 32);  // every plan has its own name
}

TEST_CASE("plan: from_int rejects bits outside the flags", "[plan]") {
  for (int64_t bits : {32L, 33L, 64L, 255L, -1L, -16L, int64_t{1} << 40}) {
    CAPTURE(bits);
    CHECK_THROWS_AS(Plan::from_int(bits), c10::Error);
    CHECK(openwam_test::error_of([bits] { Plan::from_int(bits); }) ==
          "openwam: plan must be a combination of the plan flags (0..31), got " +
              std::to_string(bits));
  }
}

TEST_CASE("plan: to_string joins the flags in a fixed order", "[plan]") {
  CHECK(make(true, false, false, false).to_string() == "padding_mask");
  CHECK(make(false, true, false, false).to_string() == "pad_keys_backward");
  CHECK(make(false, false, true, false).to_string() == "pad_keys_forward");
  CHECK(make(false, false, false, true).to_string() == "pad_query_backward");
  CHECK(make(true, false, false, true).to_string() == "padding_mask+pad_query_backward");
  CHECK(make(true, true, false, false).to_string() == "padding_mask+pad_keys_backward");
  CHECK(make(false, false, true, true).to_string() == "pad_keys_forward+pad_query_backward");
  CHECK(make(true, true, true, true).to_string() ==
        "padding_mask+pad_keys_backward+pad_keys_forward+pad_query_backward");
}
