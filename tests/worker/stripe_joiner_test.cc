// StripeJoiner and the lane fields of ring frames: striped messages are handed to the Mailbox
// whole and in lane 0's order, and a message that lost a piece with an aborted collective never
// holds back what comes after it.
#include "worker/stripe_joiner.h"

#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace meshrun {
namespace {

using ::testing::HasSubstr;

constexpr int kWorld = 3;
constexpr int kSrc = 1;

// A frame as gRPC hands it over: the header and payload cut into slices of 5 bytes.
std::vector<grpc::Slice> Slices(const FrameHeader& h, const std::string& payload) {
  const std::string bytes = EncodeFrameHeader(h) + payload;
  std::vector<grpc::Slice> slices;
  for (size_t i = 0; i < bytes.size(); i += 5) {
    slices.emplace_back(bytes.data() + i, std::min<size_t>(5, bytes.size() - i));
  }
  return slices;
}

class StripeJoinerTest : public ::testing::Test {
 protected:
  absl::Status Feed(int lane, uint64_t epoch, uint64_t tag, int stripes,
                    const std::string& payload) {
    FrameHeader h;
    h.src_rank = kSrc;
    h.lane = lane;
    h.stripes = stripes;
    h.epoch = epoch;
    h.tag = tag;
    FrameReader reader(Slices(h, payload));
    absl::StatusOr<FrameHeader> read = reader.ReadHeader();
    if (!read.ok()) return read.status();
    return joiner_.Receive(kSrc, lane, *read, reader);
  }
  // The next delivered message tagged `tag`, or the error if none is there now.
  absl::StatusOr<std::string> Next(uint64_t tag) { return mailbox_.Take(kSrc, tag, absl::Now()); }
  bool NothingDelivered() { return Next(0).status().code() == absl::StatusCode::kDeadlineExceeded; }

  Mailbox mailbox_{kWorld};
  StripeJoiner joiner_{&mailbox_, kWorld};
};

TEST_F(StripeJoinerTest, PiecesJoinInAnyOrderAndMessagesKeepTheirSendOrder) {
  ASSERT_TRUE(Feed(2, 0, 7, 1, "piece2").ok());  // before its message's first piece
  EXPECT_TRUE(NothingDelivered());
  ASSERT_TRUE(Feed(0, 0, 7, 3, "piece0;").ok());
  ASSERT_TRUE(Feed(0, 0, 8, 1, "whole").ok());  // waits behind message 7
  ASSERT_TRUE(Feed(0, 0, 9, 2, "first;").ok());
  EXPECT_TRUE(NothingDelivered());
  ASSERT_TRUE(Feed(1, 0, 7, 1, "piece1;").ok());  // completes 7; 8 follows; 9 lacks lane 1
  absl::StatusOr<std::string> m = Next(7);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(*m, "piece0;piece1;piece2");
  m = Next(8);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(*m, "whole");
  EXPECT_TRUE(NothingDelivered());
  ASSERT_TRUE(Feed(1, 0, 9, 1, "second").ok());
  m = Next(9);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(*m, "first;second");
  EXPECT_EQ(joiner_.dropped(), 0);
}

TEST_F(StripeJoinerTest, AMessageThatLostAPieceIsDroppedWhenLaneZeroMovesToALaterEpoch) {
  ASSERT_TRUE(Feed(0, 0, 5, 2, "stale piece 0").ok());      // its piece 1 went with a broken stream
  ASSERT_TRUE(Feed(2, 0, 4, 1, "stale early piece").ok());  // no message waits for lane 2
  ASSERT_TRUE(Feed(0, 1, 5, 1, "fresh").ok());
  EXPECT_EQ(joiner_.dropped(), 2);
  mailbox_.Reset(1);
  absl::StatusOr<std::string> m = Next(5);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(*m, "fresh");
  EXPECT_TRUE(NothingDelivered());
}

TEST_F(StripeJoinerTest, AMessageThatLostAPieceIsDroppedWhenItsLaneMovesToALaterEpoch) {
  ASSERT_TRUE(Feed(0, 0, 5, 3, "stale piece 0").ok());
  ASSERT_TRUE(Feed(2, 0, 5, 1, "stale piece 2").ok());
  ASSERT_TRUE(Feed(1, 1, 5, 1, "fresh piece 1").ok());  // lane 1 is in epoch 1: drops tag 5
  EXPECT_EQ(joiner_.dropped(), 1);
  ASSERT_TRUE(Feed(0, 1, 5, 2, "fresh piece 0;").ok());
  mailbox_.Reset(1);
  absl::StatusOr<std::string> m = Next(5);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(*m, "fresh piece 0;fresh piece 1");
  EXPECT_TRUE(NothingDelivered());
}

TEST_F(StripeJoinerTest, AMessageWhoseLaneMovedOnBeforeItCameIsDroppedWithItsEarlyPieces) {
  // Pieces 1 (epoch 1) and 2 (epoch 0) came first; the epoch-0 message's piece 1 was lost.
  ASSERT_TRUE(Feed(1, 1, 6, 1, "fresh piece 1").ok());
  ASSERT_TRUE(Feed(2, 0, 5, 1, "stale piece 2").ok());
  ASSERT_TRUE(Feed(0, 0, 5, 3, "stale piece 0").ok());
  EXPECT_EQ(joiner_.dropped(), 1);
  ASSERT_TRUE(Feed(0, 1, 6, 2, "fresh piece 0;").ok());
  mailbox_.Reset(1);
  absl::StatusOr<std::string> m = Next(6);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(*m, "fresh piece 0;fresh piece 1");
  EXPECT_TRUE(NothingDelivered());
}

TEST_F(StripeJoinerTest, APieceOfAnEarlierEpochThanItsMessageIsDropped) {
  ASSERT_TRUE(Feed(0, 2, 3, 2, "a;").ok());
  ASSERT_TRUE(Feed(1, 1, 3, 1, "stale").ok());
  EXPECT_EQ(joiner_.dropped(), 1);
  ASSERT_TRUE(Feed(1, 2, 3, 1, "b").ok());
  mailbox_.Reset(2);
  absl::StatusOr<std::string> m = Next(3);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(*m, "a;b");
}

TEST_F(StripeJoinerTest, APieceTaggedOtherwiseThanItsMessageIsRefused) {
  ASSERT_TRUE(Feed(0, 0, 5, 2, "a").ok());
  absl::Status s = Feed(1, 0, 6, 1, "b");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("lane 1 is tagged 6; the message it joins is tagged 5"));
  // The same when the piece came first.
  ASSERT_TRUE(Feed(2, 0, 9, 1, "c").ok());
  s = Feed(0, 0, 8, 3, "d");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
}

TEST(RingFrameTest, TheHeaderCarriesTheLaneAndTheStripeCount) {
  FrameHeader h;
  h.src_rank = 2;
  h.lane = 15;
  h.stripes = 16;
  h.epoch = 9;
  h.tag = 11;
  h.cluster_id = "c";
  FrameReader reader(Slices(h, "xy"));
  absl::StatusOr<FrameHeader> read = reader.ReadHeader();
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->lane, 15);
  EXPECT_EQ(read->stripes, 16);
  EXPECT_EQ(read->flags, 0);
  EXPECT_EQ(read->cluster_id, "c");
  EXPECT_EQ(reader.remaining(), 2u);

  std::string bytes = EncodeFrameHeader(h);
  bytes[5] |= 0x10;  // flag bit 12: not defined
  FrameReader bad({grpc::Slice(bytes.data(), bytes.size())});
  read = bad.ReadHeader();
  EXPECT_EQ(read.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(read.status().message(), HasSubstr("not defined"));
}

TEST(RingFrameTest, AStreamKeepsItsLaneAndOnlyLaneZeroCarriesAStripeCount) {
  Mailbox mailbox(kWorld);
  auto joiner = std::make_shared<StripeJoiner>(&mailbox, kWorld);
  FrameHeader h;
  h.src_rank = kSrc;
  h.lane = 1;
  h.cluster_id = "c";
  {
    RingStreamReceiver stream(joiner, kWorld, "c");
    ASSERT_TRUE(stream.Receive(Slices(h, "p")).ok());
    h.cluster_id.clear();
    h.lane = 2;
    absl::Status s = stream.Receive(Slices(h, "q"));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr("on lane 2 in rank 1's stream on lane 1"));
  }
  RingStreamReceiver stream(joiner, kWorld, "c");
  h.cluster_id = "c";
  h.lane = 3;
  h.stripes = 2;
  absl::Status s = stream.Receive(Slices(h, "r"));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("only lane 0 carries a stripe count"));
}

}  // namespace
}  // namespace meshrun
